"""A new base advantage estimator (RLOO), registered and run under TurnSight.

    python docs/examples/custom_advantage.py               # the estimator alone (seconds)
    python docs/examples/custom_advantage.py --train-step  # + one fused, jitted train step with it

See docs/adding_an_algorithm.md. The script

1. registers `rloo` (REINFORCE leave-one-out: A_i = r_i - mean of the other rewards of i's
   group) in `turnsight_jax.rl.advantages` with `register_advantage`;
2. builds it with `make_advantage_fn`, plain and wrapped by TurnSight, jits both and checks them
   against numpy and TurnSight's guarantees (same sign, |Ã / A| within [1 - λ·ε_w, 1 + λ·ε_w]);
3. with --train-step: runs one step of the real fused train step (`train_step.make_train_step`)
   on a tiny random Qwen3 and real trajectories, with `rloo` as TurnSight's base, chosen by name
   exactly as `--config.rl.base=rloo` would choose it (the step reads the registry).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from turnsight_jax.rl import advantages as adv_lib


# ---- 1. the estimator ------------------------------------------------------------------------
@adv_lib.register_advantage("rloo", ("rewards", "group_ids", "policy_mask"))
def rloo_advantages(rewards, group_ids, policy_mask, *, num_groups=None):
    """rewards [B] float, group_ids [B] int, policy_mask [B, T] bool -> [B, T] float32.

    A_i = r_i - (sum_g - r_i) / (n_g - 1) on policy tokens; 0 for a group of one, and off policy.
    Pure jax.numpy with segment sums: jit-able, no Python loop over trajectories."""
    num_groups = rewards.shape[0] if num_groups is None else num_groups
    rewards = jnp.asarray(rewards, jnp.float32)
    total = jax.ops.segment_sum(rewards, group_ids, num_segments=num_groups)
    count = jax.ops.segment_sum(jnp.ones_like(rewards), group_ids, num_segments=num_groups)
    n, s = count[group_ids], total[group_ids]
    adv = jnp.where(n > 1, rewards - (s - rewards) / jnp.maximum(n - 1, 1.0), 0.0)
    return jnp.where(policy_mask, adv[:, None], 0.0)


def rloo_numpy(rewards, group_ids):
    out = np.zeros_like(rewards)
    for i, g in enumerate(group_ids):
        others = [rewards[j] for j in range(len(rewards)) if group_ids[j] == g and j != i]
        out[i] = rewards[i] - np.mean(others) if others else 0.0
    return out


# ---- 2. the estimator alone and under TurnSight ----------------------------------------------
def check_estimator() -> None:
    rng = np.random.default_rng(0)
    G, num_groups, T, D, K = 4, 3, 24, 3, 4  # rollouts per prompt, prompts, tokens, depths, turns
    B = G * num_groups
    group_ids = np.repeat(np.arange(num_groups), G).astype(np.int32)
    rewards = rng.integers(0, 2, B).astype(np.float32)
    rewards[:G] = 1.0  # one group where every rollout succeeded: no signal
    policy_mask = rng.random((B, T)) < 0.7
    turn_ids = np.where(policy_mask, np.minimum(np.arange(T) // (T // K), K - 1)[None, :], -1).astype(np.int32)
    batch = {"rewards": rewards, "group_ids": group_ids, "policy_mask": policy_mask, "turn_ids": turn_ids,
             "delta": rng.normal(0, 0.5, (D, B, T)).astype(np.float32)}  # teacher - student log-probs
    batch = {k: jnp.asarray(v) for k, v in batch.items()}

    plain = jax.jit(adv_lib.make_advantage_fn("rloo", base_kwargs={"num_groups": num_groups}))
    lam, eps_w = 0.5, 0.5
    mixed = jax.jit(adv_lib.make_advantage_fn(
        "rloo", base_kwargs={"num_groups": num_groups},
        turnsight={"lam": lam, "eps_w": eps_w, "num_groups": num_groups, "max_turns": K}))

    a = np.asarray(plain(batch)["advantages"])
    want = np.where(policy_mask, rloo_numpy(rewards, group_ids)[:, None], 0.0)
    np.testing.assert_allclose(a, want, atol=1e-6)
    assert np.all(a[:G] == 0.0), "a group with equal rewards has no advantage"

    out = mixed(batch)
    base, tilde = np.asarray(out["base_advantages"]), np.asarray(out["advantages"])
    np.testing.assert_allclose(base, a, atol=1e-6)
    assert np.all(np.sign(tilde) == np.sign(base)), "TurnSight keeps the direction of the base advantage"
    nz = base != 0
    ratio = tilde[nz] / base[nz]
    assert ratio.min() >= 1 - lam * eps_w - 1e-6 and ratio.max() <= 1 + lam * eps_w + 1e-6
    # one weight per (trajectory, turn): every token of a turn shares it
    w = np.asarray(out["weights"])
    for b in range(B):
        for k in range(K):
            sel = policy_mask[b] & (turn_ids[b] == k)
            if sel.any():
                assert np.ptp(w[b, sel]) == 0.0
    print(f"rloo: registered estimators {sorted(adv_lib.ADVANTAGE_FNS)}")
    print(f"rloo: rewards {rewards.tolist()} -> advantages "
          f"{[round(float(x), 3) for x in rloo_numpy(rewards, group_ids)]}")
    print(f"rloo + TurnSight: |Ã/A| in [{ratio.min():.3f}, {ratio.max():.3f}], "
          f"agreement rate {float(out['agreement_rate']):.2f}, depth histogram {np.asarray(out['depth_histogram']).tolist()}")


# ---- 3. the same estimator inside the fused train step ---------------------------------------
def check_train_step() -> None:
    import optax
    from flax import nnx

    from turnsight_jax import train_step as ts
    from turnsight_jax.assets import default_tokenizer
    from turnsight_jax.rl.batch import make_train_batch
    from turnsight_jax.envs.ftrl import FTRLEnv
    from turnsight_jax.envs.synthetic import SyntheticConfig, generate_task, gold_turn_texts
    from turnsight_jax.models.config import Qwen3Config
    from turnsight_jax.models.qwen3 import init_model
    from turnsight_jax.rollout.driver import ReplayPolicy, RolloutConfig, rollout
    from turnsight_jax.rl.logprobs import student_logprobs

    cfg = ts.StepConfig(algo=ts.AlgoConfig(name="turnsight", base="rloo"), group_size=2, max_turns=4,
                        logprob_chunk=256)
    cfg.validate(8)  # a registered estimator is a valid TurnSight base (and a valid rl.name)
    try:
        dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, base="not_registered")).validate(8)
        raise AssertionError("StepConfig.validate should refuse an unregistered base")
    except ts.ConfigError as e:
        print(f"unregistered base refused: {e}")

    tok = default_tokenizer()
    tasks = [generate_task(c, s, SyntheticConfig(hops=2)) for s, c in
             enumerate(["multi_hop", "single_hop", "parallel_single_hop", "multi_hop"])]
    scripts = [s for t in tasks for s in (gold_turn_texts(t), ["<answer>no idea</answer>"])]
    with FTRLEnv(num_workers=1) as env:
        trajs = rollout(ReplayPolicy(tok, scripts), env, tasks, tokenizer=tok, group_size=2,
                        config=RolloutConfig(max_turns=4, max_response_tokens=1024)).trajectories
    batch, stats = make_train_batch(trajs, tok, cfg)
    qcfg = Qwen3Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=16)
    graphdef, params = nnx.split(init_model(qcfg, seed=0))
    _, ref_params = nnx.split(init_model(qcfg, seed=1))
    # Replayed turns carry no sampling log-probs: use the policy's own (as if it had sampled them).
    old = student_logprobs(nnx.merge(graphdef, params), jnp.asarray(batch.tokens), jnp.asarray(batch.valid),
                           jnp.asarray(batch.pol_pos), chunk=256)
    batch = batch.replace(old_logprobs=np.where(batch.pol_valid, np.asarray(old), 0.0).astype(np.float32))
    optimizer = ts.make_optimizer(ts.OptimConfig(lr=1e-3))
    step = ts.make_train_step(graphdef, cfg, optimizer)
    params, opt_state, metrics = step(params, optimizer.init(params), ref_params, jax.tree.map(jnp.asarray, batch))
    metrics = jax.device_get(metrics)
    # w = 1 + eps_w * tanh(...) lies in [1 - eps_w, 1 + eps_w] = [0.5, 1.5] by default
    assert np.isfinite(metrics["pg_loss"]) and metrics["grad_norm"] > 0 and 0.5 <= metrics["weight_min"] <= metrics["weight_max"] <= 1.5
    print(f"train step with turnsight(rloo): rewards {batch.rewards.tolist()}, pg_loss {metrics['pg_loss']:.4f}, "
          f"grad_norm {metrics['grad_norm']:.3f}, weights [{metrics['weight_min']:.3f}, {metrics['weight_max']:.3f}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train-step", action="store_true", help="also run one fused train step with the estimator")
    args = ap.parse_args()
    check_estimator()
    if args.train_step:
        check_train_step()
    print("ok")


if __name__ == "__main__":
    main()
