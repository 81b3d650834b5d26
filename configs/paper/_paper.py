"""The paper's runs as config layers: one place for what every `configs/paper/*.py` row shares.

A row is `row(method, model)` (Table 1: the same run for every method, only the method changes)
or `ablation(change)` (Table 2 / Figure 6: the main TurnSight Qwen3-8B config with exactly one
thing changed). docs/reproducing.md maps every file to its paper cell. Both start from configs/qwen3_8b.py's
experiment (FTRL, 32 prompts x 16 rollouts, 10 turns, lr 1e-6, fsdp over 8 devices) and add
`released`: the released MatchTIR code's conventions (docs/spec.md §1 "Released code" and §3),
which the published numbers were produced with. Each is one override away, e.g.
`--config.rl.matchtir_semantics=clean` or `--config.rl.matchtir_matching=assignment` for the
paper's text (optimal Kuhn-Munkres) instead of the released greedy matching.

The model is the post-trained `Qwen/Qwen3-8B` / `Qwen/Qwen3-4B` with thinking on (docs/spec.md §2:
the paper's untrained scores fit those, not `-Base`); pass its folder with
`--config.model.hf_path=/path/to/Qwen3-8B`.
"""

from __future__ import annotations

import pathlib

from turnsight_jax.config import layered, load_config_module, model_file

CONFIGS = pathlib.Path(__file__).resolve().parents[1]
MODELS = {"8b": "qwen3_8b", "4b": "qwen3_4b"}
METHODS = ("vanilla", "grpo", "toolrl", "matchtir", "turnsight", "rlsd", "sdpo", "sdar", "sod")
# The self-distillation baselines (docs/baselines.md; docs/reproducing.md says what was chosen
# where their papers are silent): method, base, teacher.* values, method knobs ("<section>.<key>").
BASELINES = {
    "rlsd": dict(base="matchtir", weights="policy", source="gold_answer", placement="prompt"),
    "sdpo": dict(base="grpo", weights="policy", source="sibling", placement="prompt", knobs={"sdpo.coef": 0.1}),
    "sdar": dict(base="grpo", weights="policy", source="skill", placement="prompt",
                 knobs={"sdar.coef": 0.1, "sdar.beta": 1.0}),
    "sod": dict(base="grpo", weights="external", source="none", placement="prompt",
                knobs={"sod.coef": 0.1, "sod.tau": 1.0}),
}
# SOD's external teacher: a larger Qwen3 with the same tokenizer (pass its folder with
# --config.teacher.checkpoint=/path/to/Qwen3-32B; the preset lets --dry-run plan it without the folder).
SOD_TEACHER = dict(checkpoint="Qwen/Qwen3-32B", preset="qwen3-32b")


def released(c) -> None:
    """The released MatchTIR code's conventions (quchangle1/MatchTIR, the verl fork TurnSight
    inherits; docs/spec.md §1.11 and §3), in place."""
    # rewards: greedy sort-and-assign matching, unnormalised OT, case-insensitive names, Python ==,
    # set-based answer F1 (0 without <answer> tags); a pool of one passes the raw value
    c.rl.matchtir_matching = "greedy"
    c.rl.matchtir_semantics = "released"
    c.rl.matchtir_singleton = "raw"
    c.rl.toolrl_format = False  # the released compute_toolrl has no format term
    # loss: verl's dual clip c = 3 and the symmetric eps = 0.2
    c.loss.clip_ratio_c = 3.0
    c.loss.clip_eps = c.loss.clip_eps_high = 0.2
    # context and rollout: observation tokens masked out of the training forward; a turn whose calls
    # all fail to parse ends the episode; calls written inside <think> are executed
    c.rl.student_sees_observations = False
    c.rollout.end_on_unparsable_turn = True
    c.rollout.calls_in_think = True
    # observation text: the released rollout's (vllm_rollout_spmd.py: `<|im_start|>user\n` right after
    # the sampled <|im_end|>, a newline after each </tool_response>); the paper is silent
    c.rollout.observation_template = "released"
    # evaluation: greedy, 10 turns on FTRL; thinking on (post-trained Qwen3)
    c.eval.temperature = 0.0
    c.eval.max_turns = 10
    c.rollout.enable_thinking = True
    # Kept from base_config, not the released code's (docs/reproducing.md, "Where the paper configs
    # differ from the released code"): tool results cut at 16,384 characters (the released code does
    # not cut).
    c.rollout.max_tool_output_chars = 16_384


def _experiment():
    return load_config_module(CONFIGS / "qwen3_8b.py").experiment


def row(method: str, model: str = "8b"):
    """Table 1: `method` (vanilla | grpo | toolrl | matchtir | turnsight on MatchTIR | the
    self-distillation baselines rlsd, sdpo, sdar, sod) on Qwen3-`model`."""
    if method not in METHODS or model not in MODELS:
        raise ValueError(f"row({method!r}, {model!r}): method in {METHODS}, model in {tuple(MODELS)}")
    c = layered(model=model_file(CONFIGS / "qwen3_8b.py", MODELS[model]), experiment=[_experiment(), released])
    c.name = f"paper_{method}_{model}"
    if method == "vanilla":  # the untrained model: held-out evaluation only (BFCL/ToolHop: the evaluate CLI)
        c.rl.method, c.rl.base = "grpo", "grpo"
        c.train.steps = 0
    elif method == "turnsight":
        c.rl.method, c.rl.base = "turnsight", "matchtir"
    elif method in BASELINES:
        b = BASELINES[method]
        c.rl.method, c.rl.base = method, b["base"]
        c.teacher.weights, c.privileged.source, c.privileged.placement = b["weights"], b["source"], b["placement"]
        for key, value in b.get("knobs", {}).items():  # "<method section>.<key>"
            section, name = key.split(".")
            c[section][name] = value
        if method == "sod":
            c.teacher.checkpoint, c.teacher.preset = SOD_TEACHER["checkpoint"], SOD_TEACHER["preset"]
            if model == "8b":  # the 32B teacher (8 GiB per device) stays resident while rolling out:
                c.rollout.decode_slots = 96  # with 128 slots' full KV pool the rollout planned 80.45 GiB per device
                c.rollout.kv_pool_blocks = 16_000  # 35.2 GiB: within the launchers' 0.90 share (--dry-run)
    else:
        c.rl.method = method
        c.rl.base = method if method != "toolrl" else "grpo"
    # Every Table 1 row is the paper's setup (docs/spec.md §2: KL 0, no entropy bonus) and differs from
    # the TurnSight row of its size in the method alone. MatchTIR's own released recipe (KL 0.001,
    # entropy 0.001, 256 prompts per step, ...) is configs/released/matchtir_8b.py, not a paper cell.
    return c


def ablation(name: str, change):
    """Table 2 / Figure 6: the main TurnSight Qwen3-8B row with `change(c)` applied."""
    c = row("turnsight", "8b")
    change(c)
    c.name = f"paper_ablation_{name}"
    return c
