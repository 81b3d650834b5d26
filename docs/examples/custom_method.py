"""A new training method, `rloo_efficient`: its own settings, reward, advantage estimator, loss
term and trainer hook.

    python -m turnsight_jax.train --config docs/examples/custom_method.py --workdir /tmp/rloo_efficient

docs/adding_an_algorithm.md walks through this file. Loading it registers

* the config section `rloo_efficient.*` (`call_penalty`, `nll_coef`), generated from a dataclass
  whose defaults are the defaults (`--config.rloo_efficient.call_penalty=0.2` overrides one);
* the reward `call_efficiency`: the environment's outcome minus `call_penalty` (0.1) per tool
  call beyond the task's gold call count, into the batch array "efficiency_rewards";
* the advantage estimator `rloo`: REINFORCE leave-one-out, r_i minus the mean of the other G-1
  rewards of i's group, on every policy token;
* the loss term `success_nll`: `nll_coef` (0.05) x the negative log-likelihood of the policy
  tokens of trajectories that fully solved their task (outcome >= 1), a self-imitation term;
* the rollout controller `wasted_calls`: the default sampler, whose trainer hook keeps the run's
  tally of wasted calls across steps and resumes (saved with every checkpoint) and logs it;
* the method `rloo_efficient` made of them (with the clipped surrogate),

and `get_config()` is the embedded default running that method for 2 RL steps on the built-in
tasks after an 8-step warm-start (a couple of minutes on a CPU). TurnSight composes over it unchanged:
`--config.rl.method=turnsight --config.rl.base=rloo_efficient`.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import ml_collections as mlc

from turnsight_jax.config import default_config
from turnsight_jax.errors import ConfigError
from turnsight_jax.rl.advantages import register_advantage
from turnsight_jax.rl.config import section_settings
from turnsight_jax.rl.groups import group_gather
from turnsight_jax.rl.losses import register_loss_term
from turnsight_jax.rl.methods import (METHODS, Method, TrainerHook, register_config_section, register_method,
                                      register_reward, register_rollout, sampler_rollout)


# ---- 1. the settings: a config section, its dataclass's defaults the only ones -----------------
@dataclasses.dataclass(frozen=True)
class RlooEfficientConfig:
    """The run config's `rloo_efficient.*` section."""

    call_penalty: float = 0.1  # outcome points per tool call beyond the gold chain's
    nll_coef: float = 0.05  # coefficient of the self-imitation NLL

    def validate(self) -> "RlooEfficientConfig":
        for key in ("call_penalty", "nll_coef"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value)
                                                                                      and value >= 0):
                raise ConfigError(f"rloo_efficient.{key} must be a finite number >= 0, got {value!r}")
        return self


def check_settings(cfg, stages, check_data: bool) -> None:
    """config.validate calls this with the run config: a bad value is an error before anything runs."""
    section_settings(RlooEfficientConfig, cfg.rloo_efficient, "rloo_efficient", "an rloo_efficient")


def wasted_calls(traj, task) -> int:
    """Calls beyond the gold chain's (a task without gold calls, e.g. an FTRL test row, wastes
    none). Malformed calls count: they were attempts."""
    made = sum(len(turn.calls) for turn in traj.turns)
    gold = sum(len(turn) for turn in task.gold_calls) if task.gold_calls is not None else made
    return max(made - gold, 0)


# ---- 2. the reward: host-side, per trajectory, from the rollout record ------------------------
def call_efficiency(traj, task, algo) -> float:
    """Outcome minus `call_penalty` per wasted call."""
    return float(traj.reward) - algo.section("rloo_efficient").call_penalty * wasted_calls(traj, task)


# ---- 3. the advantage estimator: pure jax.numpy, jitted inside the train step ----------------
def rloo_advantages(rewards, group_ids, policy_mask, *, num_groups):
    """rewards [B] float, group_ids [B] int, policy_mask [B, N] bool -> [B, N] float32.

    A_i = r_i - (S_g - r_i) / (n_g - 1), S_g and n_g the sum and size of i's group, on policy
    tokens; 0 off them, for a group of one and for an id outside [0, num_groups). Groups are
    formed with segment sums, so siblings need not be adjacent. Rewards are shifted by their group
    maximum first (A is shift-invariant): a group of equal rewards then gives exactly 0."""
    rewards = jnp.asarray(rewards, jnp.float32)
    gmax = jax.ops.segment_max(rewards, group_ids, num_segments=num_groups)
    r = rewards - group_gather(jnp.where(jnp.isfinite(gmax), gmax, 0.0), group_ids, num_groups)
    total = group_gather(jax.ops.segment_sum(r, group_ids, num_segments=num_groups), group_ids, num_groups)
    count = group_gather(jax.ops.segment_sum(jnp.ones_like(r), group_ids, num_segments=num_groups),
                         group_ids, num_groups)
    adv = jnp.where(count > 1, r - (total - r) / jnp.maximum(count - 1.0, 1.0), 0.0)
    return jnp.where(policy_mask, adv[:, None], 0.0)


# ---- 4. the auxiliary loss term: per token, inside the jitted step ---------------------------
def success_nll(x, loss_cfg, algo):
    """nll_coef x (-log pi(token)) on the policy tokens of trajectories with outcome >= 1.

    x["rewards"] is the outcome reward [B] (the built-in `outcome` reward fills it), x["logprobs"]
    the student's log-probs [B, N] (differentiated), x["pol_valid"] the real policy slots [B, N].
    The metric is the uncoefficiented NLL (the step weights it like the loss)."""
    solved = (x["rewards"] >= 1.0)[:, None] & x["pol_valid"]
    nll = jnp.where(solved, -x["logprobs"], 0.0)
    return algo.section("rloo_efficient").nll_coef * nll, {"success_nll": nll}


# ---- 5. a trainer hook: state across steps, saved with every checkpoint ----------------------
class WastedCallsTally(TrainerHook):
    """This process's tally of wasted calls over the run. The controller below adds each step's
    rollouts to it; after each step the trainer logs the running mean; every checkpoint saves it
    (`wasted_calls.json` in the step folder) and a resumed run starts from the saved tally."""

    FILE = "wasted_calls.json"

    def __init__(self, start):
        saved = start.checkpoint_file(self.FILE)
        state = json.loads(saved) if saved is not None else {"wasted": 0, "episodes": 0}
        self.wasted, self.episodes = int(state["wasted"]), int(state["episodes"])

    def rollout_state(self):
        return self  # the controller reads it as ctx.state

    def after_step(self, step, graphdef, params, env) -> dict[str, float]:
        return {"rloo_efficient/wasted_calls_per_episode": self.wasted / max(self.episodes, 1),
                "rloo_efficient/episodes_tallied": float(self.episodes)}

    def checkpoint_files(self) -> dict[str, str]:
        return {self.FILE: json.dumps({"wasted": self.wasted, "episodes": self.episodes})}


def tallying_rollout(ctx, tasks, seed):
    """The default sampler (G siblings of task i in rows i*G .. i*G+G-1), tallied into ctx.state."""
    result = sampler_rollout(ctx, tasks, seed)
    for row, traj in enumerate(result.trajectories):
        ctx.state.wasted += wasted_calls(traj, tasks[row // ctx.group_size])
        ctx.state.episodes += 1
    return result


# ---- 6. the method, and the registration --------------------------------------------------
def register() -> None:
    """Register the pieces; a no-op when already done (the trainer executes a config file each time
    it loads it, and the registries refuse a second entry of the same name)."""
    if "rloo_efficient" in METHODS:
        return
    register_config_section("rloo_efficient", RlooEfficientConfig, check_settings)
    register_reward("call_efficiency", output="efficiency_rewards")(call_efficiency)
    register_advantage("rloo", inputs=("efficiency_rewards", "group_ids", "policy_mask"),
                       knobs=("num_groups",))(rloo_advantages)
    register_loss_term("success_nll", inputs=("logprobs", "rewards", "pol_valid"),
                       metrics=("success_nll",))(success_nll)
    register_rollout("wasted_calls", trainer_hook=WastedCallsTally)(tallying_rollout)
    register_method(Method(
        "rloo_efficient", advantage="rloo", rewards=("outcome", "call_efficiency"),
        loss_terms=("clipped_surrogate", "success_nll"), rollout="wasted_calls",
        description="leave-one-out advantage of an outcome that pays for wasted calls, plus self-imitation",
    ))


register()


# ---- 7. the run config ------------------------------------------------------------------------
def get_config() -> mlc.ConfigDict:
    """The embedded default with `rl.method=rloo_efficient`: 2 RL steps of 2 prompts x 2 rollouts,
    2 held-out tasks sampled once, no export. Its `rloo_efficient.*` section is there with the
    dataclass's defaults (registered above, before the config is built).

    The warm-start is cut to 8 plain SFT steps (no curriculum). Without any, the random model
    writes no tool call, every reward of a group is equal and the update is exactly 0; after these
    steps it imitates the demonstrator's calls (some wasted, `sft.wrong_call_rate`), so call counts,
    and thus `call_efficiency`, differ between siblings and RLOO has something to push."""
    c = default_config()
    c.name = "rloo_efficient"
    c.rl.method = "rloo_efficient"
    c.sft.curriculum_steps = 0
    c.sft.steps = 8
    c.sft.batch_size = 2
    c.sft.num_tasks = 16
    c.train.steps = 2
    c.train.prompts_per_step = 2
    c.train.group_size = 2
    c.rollout.max_turns = 2
    c.rollout.max_turn_tokens = 24
    c.rollout.max_response_tokens = 64
    c.data.num_eval = 2
    c.eval.samples = 1
    c.eval.max_turns = 2
    c.checkpoint.export_at_end = False
    c.log.tensorboard = False
    return c
