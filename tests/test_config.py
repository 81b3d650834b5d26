"""Config layers (base, model, experiment), the embedded default, the paper configs, overrides."""

from __future__ import annotations

import dataclasses

import json
import pathlib

import pytest

from turnsight_jax import config as C
from turnsight_jax import embedded_default
from turnsight_jax.errors import ConfigError
from turnsight_jax.models.config import PRESETS

REPO = pathlib.Path(__file__).resolve().parents[1]

# `default_config().to_dict()` before the config layers (commit d78ba01), value for value: the
# embedded default must not move when the layering does. (rl.args, the plug-in knobs, is new and empty.)
TODAY_DEFAULT = {'checkpoint': {'every': 10, 'export_at_end': True, 'keep': 2},
                 'data': {'categories': ('single_hop', 'multi_hop'),
                          'entity_style': 'names',
                          'eval_path': '',
                          'eval_source': 'builtin',
                          'extra_rows': 1,
                          'hops': 2,
                          'max_distractors': 1,
                          'min_distractors': 1,
                          'num_eval': 64,
                          'num_relations': 4,
                          'num_train': 2000,
                          'path': '',
                          'prompt_style': 'short',
                          'source': 'builtin',
                          'vocab_size': 10,
                          'width': 2},
                 'eval': {'batch_size': 64,
                          'every': 0,
                          'max_turns': 4,
                          'samples': 4,
                          'temperature': 1.0,
                          'top_k': 20,
                          'top_p': 1.0},
                 'log': {'progress': True, 'records_every': 1, 'records_max_kib': 8192, 'records_text_chars': 4000,
                         'tensorboard': True, 'wandb': False, 'wandb_mode': 'online', 'wandb_project': 'turnsight_jax'},
                 'loss': {'aggregation': 'seq_mean_token_mean',
                          'clip_eps': 0.2,
                          'clip_eps_high': 0.28,
                          'kl_clip': 10.0,
                          'kl_coef': 0.0,
                          'kl_estimator': 'low_var_kl'},
                 'mesh': {'data': 1, 'fsdp': -1, 'tensor': 1},
                 'model': {'allow_random_init': True,
                           'attn_q_chunk': 128,
                           'compute_dtype': 'float32',
                           'hf_path': '',
                           'param_dtype': 'float32',
                           'preset': 'tiny-default',
                           'ref_dtype': 'float32',
                           'remat': False},
                 'name': 'tiny_cpu',
                 'optim': {'b1': 0.9,
                           'b2': 0.99,
                           'lr': 0.0003,
                           'max_grad_norm': 1.0,
                           'min_lr_ratio': 0.0,
                           'schedule': 'constant',
                           'warmup_steps': 2,
                           'weight_decay': 0.0},
                 'plan': {'device_memory_gib': 80.0, 'distinct_factor': 3.0, 'packed_factor': 2.0},
                 'rl': {'aggregation': 'turn',
                        'base': 'grpo',
                        'depths': (1, 2, 3),
                        'eps_w': 0.5,
                        'gamma': 0.9,
                        'group_norm': True,
                        'lam': 0.5,
                        'matchtir_matching': 'assignment',
                        'matchtir_semantics': 'clean',
                        'matchtir_singleton': 'zero',
                        'method': 'turnsight',
                        'selection': 'vote',
                        'source': 'tool_results',
                        'toolrl_format': True,
                        'turns': 'all'},
                 'rollout': {'enable_thinking': False,
                             'max_prompt_tokens': 1024,
                             'max_response_tokens': 256,
                             'max_turn_tokens': 48,
                             'max_turns': 4,
                             'prompts_per_chunk': 0,
                             'engine': 'lockstep',
                             'decode_slots': 64,
                             'kv_block_size': 16,
                             'decode_chunk': 16,
                             'kv_pool_blocks': 0,
                             'temperature': 1.0,
                             'top_k': 20,
                             'top_p': 1.0},
                 'seed': 0,
                 'sft': {'batch_size': 16,
                         'curriculum_lr': 0.003,
                         'curriculum_steps': 250,
                         'lr': 0.003,
                         'num_tasks': 1024,
                         'steps': 60,
                         'wrong_call_rate': 0.5},
                 'tokenizer_path': '',
                 'train': {'group_size': 4,
                           'logprob_chunk': 256,
                           'micro_batches': 1,
                           'mini_batches': 1,
                           'ppo_epochs': 1,
                           'prompts_per_step': 8,
                           'steps': 12,
                           'teacher_micro_batches': 1}}
TODAY_DEFAULT["rl"]["args"] = {}
# The released code's semantics as switches (issue 18), all off: the default run does not move.
TODAY_DEFAULT["loss"].update(clip_ratio_c=None, entropy_coef=0.0)
# The sampler/trainer mismatch correction, off: the default run does not move.
TODAY_DEFAULT["loss"].update(tis_threshold=None)
TODAY_DEFAULT["rollout"].update(end_on_unparsable_turn=False, calls_in_think=False)
# Length classes (issue 21), off: every row padded to the batch's width, as the run was measured.
TODAY_DEFAULT["train"].update(length_classes=1)
# Row packing (issue 21), off: one trajectory per row, as the run was measured.
TODAY_DEFAULT["train"].update(pack_rows=False, pack_width=0, teacher_pack_width=0, shapes="grow", shape_reuse=0.1)
# The no-gradient forwards' head chunk (issue 21): speed only (the same log-probs to float rounding, ~2e-6).
TODAY_DEFAULT["train"].update(score_chunk=32)
# The head in vocabulary blocks (issue 21): speed only; the default run's held-out figures were the
# same with and without (BENCHMARKS.md "Train step: the head in vocabulary blocks").
TODAY_DEFAULT["model"].update(vocab_block=1024)
TODAY_DEFAULT["train"].update(logprob_chunk=640, score_chunk=256)
# Attention skipping the padding's query chunks (issue 21): speed only, the same values to float
# rounding (BENCHMARKS.md "Train step: attention skips the chunks of padding").
TODAY_DEFAULT["model"].update(attn_row_group=4)
# Key blocks in the skipping kernel (issue 21), off: speed only (the same values to float rounding),
# slower than one score block per chunk on a CPU at the default's unpacked widths (BENCHMARKS.md).
TODAY_DEFAULT["model"].update(attn_key_block=0)
# The fused attention kernel (issue 21), off: GPUs only (Triton); the XLA kernel on every backend.
TODAY_DEFAULT["model"].update(attn_impl="xla", attn_block=64)
# Micro-batch groups (issue 21), off: speed only (the same values), for micro-batches of one row per device.
TODAY_DEFAULT["train"].update(micro_batch_groups=1)
# The non-finite guard (issue 19): a bound on skipped steps, not a training value.
TODAY_DEFAULT["train"].update(max_skipped_steps=3)
TODAY_DEFAULT["rl"].update(norm_pool="turn_mean", uncovered_in_stats=True, empty_block_turns="weighted",
                           student_sees_observations=True,
                           hindsight_template={"message_open": "<|im_start|>user\n<hindsight>\n",
                                               "answer": "<answer>{answer}</answer>\n",
                                               "item": "<turn>\n{calls}{results}</turn>\n",
                                               "call": "<tool_call>\n{call}\n</tool_call>\n",
                                               "result": "<tool_response>\n{result}\n</tool_response>\n",
                                               "message_close": "</hindsight><|im_end|>\n"})
# The teacher section (issue 23's self-distillation baselines); no effect on the default method
# (its teacher is the frozen reference).
TODAY_DEFAULT["teacher"] = {"weights": "reference", "ema_decay": 0.99, "checkpoint": "", "preset": "", "top_k": 20}
# Two-stage recipes: no effect on the default method (it never switches).
TODAY_DEFAULT["rl"].update(switch_step=0, switch_method="")
# A rollout controller in place of the method's own (issue 24's rollout methods), off.
TODAY_DEFAULT["rl"].update(rollout="")
# The methods' own sections (privileged.*, sdpo.*, gae.*, bar.*, ...) are not pinned here: each is its dataclass,
# generated into the config (test_every_method_section_is_its_dataclass), their one source of truth.
# The studies of issue 26 (docs/experiments.md), all off: the default run does not move (the equal-length
# control, the adaptive horizons' tolerance, long chains, faulty tools, the turn records).
TODAY_DEFAULT["rl"].update(hindsight_budget=0, hindsight_filler=".\n", horizon_tol=0.05)
TODAY_DEFAULT["data"].update(max_hops=0)
TODAY_DEFAULT["data"].update(min_result_words=0, max_result_words=0)  # long tool results (issue 21's paper-like run): off
TODAY_DEFAULT["log"].update(turn_records=False)
TODAY_DEFAULT["faults"] = {"wrong_rate": 0.0, "unavailable_rate": 0.0, "unavailable_attempts": 1, "delay_rate": 0.0,
                           "delay_s": 0.0, "seed": 0}
# The tool-output cap (issue 58): the executor's 16,384 characters, now a key; the default run does not move.
TODAY_DEFAULT["rollout"].update(max_tool_output_chars=16_384)
# The observation text (issue 58): the official chat template's, as before; the default run does not move.
TODAY_DEFAULT["rollout"].update(observation_template="project")

# Keys where configs/qwen3_8b.py's experiment departs from base + its model layer: how the run
# fits 8 x 80 GB devices and how it evaluates. Anything else would be a value from somewhere else.
PAPER_EXPERIMENT_KEYS = {"name", "data.num_eval", "rollout.decode_slots", "rollout.kv_pool_blocks",
                         "train.micro_batches", "train.teacher_micro_batches", "train.logprob_chunk",
                         "train.micro_batch_groups"}
SMALLER_BATCH_KEYS = {"train.prompts_per_step", "train.group_size", "train.micro_batches",
                      "train.teacher_micro_batches", "train.steps", "rollout.max_prompt_tokens",
                      "rollout.max_response_tokens", "optim.lr"}


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def cfg_file(name: str):
    return C.load_config_file(REPO / "configs" / f"{name}.py")


def base_plus_model(model: str):
    return C.layered(model=C.model_file(REPO / "configs" / "x.py", model))


# ---- (a) the embedded default ----

def _without_sections(d: dict) -> dict:
    from turnsight_jax.rl.config import CONFIG_SECTIONS

    return {k: v for k, v in d.items() if k not in CONFIG_SECTIONS}


def test_embedded_default_is_todays_default():
    from turnsight_jax.rl.config import CONFIG_SECTIONS

    for cfg in (C.default_config(), C.load_run_config(None, []), cfg_file("tiny_cpu")):
        assert _without_sections(cfg.to_dict()) == TODAY_DEFAULT
        # and every method section at its dataclass's defaults
        assert {k: cfg[k].to_dict() for k in CONFIG_SECTIONS} == {
            k: dataclasses.asdict(s.schema()) for k, s in CONFIG_SECTIONS.items()}


def test_the_packed_tiny_config_changes_only_the_updates_packing():
    packed = flat(cfg_file("tiny_cpu_packed").to_dict())
    default = flat(cfg_file("tiny_cpu").to_dict())
    assert {k: v for k, v in packed.items() if default[k] != v} == {
        "name": "tiny_cpu_packed", "train.pack_rows": True, "train.pack_width": 2304,
        "train.teacher_pack_width": 3584, "train.shapes": "batch", "train.logprob_chunk": 128,
        "model.attn_key_block": 32, "model.attn_q_chunk": 32, "model.attn_row_group": 1}
    C.validate(cfg_file("tiny_cpu_packed"), 1)


def test_the_paper_like_tiny_config_is_the_packed_one_on_long_episodes():
    """configs/tiny_cpu_paper_like.py: the packed default's step and model on 2-10-turn episodes
    with 50-500-word tool results (the data, the rollout budgets, wider packed rows)."""
    long = flat(cfg_file("tiny_cpu_paper_like").to_dict())
    packed = flat(cfg_file("tiny_cpu_packed").to_dict())
    assert {k: v for k, v in long.items() if packed[k] != v} == {
        "name": "tiny_cpu_paper_like", "data.max_hops": 9, "data.vocab_size": 28, "data.num_relations": 12,
        "data.min_result_words": 50, "data.max_result_words": 500, "data.num_eval": 0,
        "rollout.max_turns": 10, "rollout.max_prompt_tokens": 1536, "rollout.max_response_tokens": 6144,
        "eval.max_turns": 10, "sft.batch_size": 4,
        "sft.curriculum_steps": 120, "sft.steps": 40, "train.prompts_per_step": 4, "train.steps": 6,
        "train.pack_width": 3328, "train.teacher_pack_width": 10240, "train.shape_reuse": 0.02,
        "model.attn_key_block": 64, "model.attn_q_chunk": 64}
    C.validate(cfg_file("tiny_cpu_paper_like"), 1)


def test_embedded_default_layers():
    base = flat(C.base_config().to_dict())
    default = flat(C.default_config().to_dict())
    assert set(base) == set(default)  # a layer sets keys, never adds them
    assert C.fixed_keys(C.default_config()) == {"model.preset": "tiny-default"}
    assert C.model_file(REPO / "configs" / "x.py", "tiny_default").keys == embedded_default.TINY_DEFAULT_MODEL
    assert C.default_config() is not C.default_config()  # fresh each call: no shared state


# ---- the base ----

def test_base_has_no_model_and_requires_data():
    base = C.base_config()
    assert base.model.preset == "" and not base.model.allow_random_init
    assert C.fixed_keys(base) == {}
    with pytest.raises(ConfigError, match="set model.preset or model.hf_path"):
        C.validate(base, 1, check_data=False)
    base.model.preset = "tiny"
    with pytest.raises(ConfigError, match=r"data.source='ftrl' needs data.path"):
        C.validate(base, 1)


def test_base_documents_every_key():
    import inspect

    lines = [ln.strip() for ln in inspect.getsource(C.base_config).splitlines() if ln.strip().startswith("c.")]
    assert lines and all("#" in ln for ln in lines), [ln for ln in lines if "#" not in ln]
    keys = {ln.split("=")[0].strip()[2:] for ln in lines}
    # a method's own section is generated from its dataclass: each field documented there (a comment
    # on its line, or its name in the class docstring)
    from turnsight_jax.rl.config import CONFIG_SECTIONS

    for name, section in CONFIG_SECTIONS.items():
        source, doc = inspect.getsource(section.schema), section.schema.__doc__ or ""
        for field in dataclasses.fields(section.schema):
            line = next(ln for ln in source.splitlines() if ln.strip().startswith(f"{field.name}:"))
            assert "#" in line or field.name in doc, f"{name}.{field.name} is documented nowhere"
            keys.add(f"{name}.{field.name}")
    assert set(flat(C.base_config().to_dict())) <= keys


def test_every_method_section_is_its_dataclass():
    """Issue 60: a method's defaults are defined once, in its dataclass; the config section is
    generated from it (and --config.<section>.<key> overrides it like any key)."""
    from turnsight_jax.rl.config import CONFIG_SECTIONS

    base = C.base_config()
    assert {"bar", "akbe", "t2po", "appo", "slim", "judge", "mm_grpo", "toolomni", "sdpo", "sdar", "sod", "gae", "orchard",
            "critic", "prm"} <= set(CONFIG_SECTIONS)
    for name, section in CONFIG_SECTIONS.items():
        assert base[name].to_dict() == dataclasses.asdict(section.schema()), name
    assert base.bar.cap == 0  # 0: train.group_size (bar_settings resolves it)


# ---- (b) the paper configs carry nothing of the tiny experiment ----

@pytest.mark.parametrize("name,model,extra", [
    ("qwen3_8b", "qwen3_8b", set()),
    ("qwen3_4b", "qwen3_4b", set()),
    ("qwen3_0_6b", "qwen3_0_6b", SMALLER_BATCH_KEYS),
])
def test_paper_configs_are_base_model_experiment(name, model, extra):
    resolved = flat(cfg_file(name).to_dict())
    reference = flat(base_plus_model(model).to_dict())
    assert set(resolved) == set(reference)
    differing = {k for k in resolved if resolved[k] != reference[k]}
    assert differing <= PAPER_EXPERIMENT_KEYS | extra, differing - PAPER_EXPERIMENT_KEYS - extra
    tiny = flat(C.default_config().to_dict())
    base = flat(C.base_config().to_dict())
    from_tiny = {k for k in tiny if k != "model.preset" and tiny[k] != base[k] and resolved[k] == tiny[k]}
    assert not from_tiny - extra, from_tiny  # no value the tiny experiment set (0.6b's 8 prompts are its own)
    c = cfg_file(name)
    assert c.sft.curriculum_steps == 0 and c.sft.steps == 0 and c.sft.wrong_call_rate == 0
    assert c.eval.temperature == 0.0 and c.eval.samples == 1  # greedy held-out evaluation
    assert c.rollout.top_k == 0 and c.eval.top_k == 0
    assert c.model.preset in PRESETS
    assert C.fixed_keys(c) == {"model.preset": {"qwen3_8b": "qwen3-8b", "qwen3_4b": "qwen3-4b",
                                                "qwen3_0_6b": "qwen3-0.6b"}[name]}
    assert "name" not in c.rl  # rl.method replaced rl.name


def test_spec_defaults_table_is_the_code():
    """docs/spec.md §2's table of defaults holds base_config()'s values, which configs/qwen3_8b.py keeps."""
    import ast
    import re

    text = (REPO / "docs" / "spec.md").read_text()
    section = text.split("These values are `base_config()`'s", 1)[1].split("\n\n", 2)[1]
    rows = [ln for ln in section.splitlines() if ln.startswith("| `")]
    base, paper = flat(C.base_config().to_dict()), flat(cfg_file("qwen3_8b").to_dict())
    seen = []
    for row in rows:
        keys_cell, values_cell, _source = [c.strip() for c in row.strip("|").split("|")]
        keys = re.findall(r"`([a-z_]+\.[a-z_0-9]+)`", keys_cell)
        values = ast.literal_eval("[" + re.sub(r"`([^`]*)`", r"'\1'", values_cell) + "]")
        assert len(keys) == len(values), row
        for key, value in zip(keys, values):
            assert base[key] == value and paper[key] == value, (key, value, base[key], paper[key])
            seen.append(key)
    assert len(seen) >= 30 and "train.steps" in seen and "eval.max_turns" in seen
    assert "eval.max_turns=20" not in text and "208 steps" not in text


@pytest.mark.parametrize("lam", ["0", "0.0", "1", "1.0"])
def test_lambda_0_and_1_are_valid(lam):
    """Figure 6's λ grid has both ends: λ = 0 (the base advantage) and λ = 1 (the full weight)."""
    c = C.load_run_config(None, [f"--config.rl.lam={lam}", "--config.rl.eps_w=0.9"])
    step_cfg, _ = C.validate(c, 1)
    assert step_cfg.algo.lam == float(lam) and step_cfg.algo.eps_w == 0.9


def test_lambda_outside_0_1_and_a_bad_tool_output_cap_are_refused():
    for lam in ("-0.1", "1.01"):
        with pytest.raises(ConfigError, match=r"rl.lam must be in \[0, 1\]"):
            C.validate(C.load_run_config(None, [f"--config.rl.lam={lam}"]), 1)
    for cap in ("0", "-5"):
        with pytest.raises(ConfigError, match="rollout.max_tool_output_chars must be an int >= 1"):
            C.validate(C.load_run_config(None, [f"--config.rollout.max_tool_output_chars={cap}"]), 1)
    C.validate(C.load_run_config(None, ["--config.rollout.max_tool_output_chars=100"]), 1)


def test_observation_template_is_validated_and_mapped():
    """rollout.observation_template (issue 58): project (default) | released; another value is a
    ConfigError naming the key and the allowed values; rollout_config carries it to the driver."""
    with pytest.raises(ConfigError, match=r"rollout.observation_template must be one of project, released.*'verl'"):
        C.validate(C.load_run_config(None, ["--config.rollout.observation_template=verl"]), 1)
    assert C.rollout_config(C.base_config()).observation_template == "project"
    c = C.load_run_config(None, ["--config.rollout.observation_template=released"])
    C.validate(c, 1)
    assert C.rollout_config(c).observation_template == "released"


def test_model_files_set_only_model_keys():
    for path in sorted((REPO / "configs" / "models").glob("*.py")):
        layer = C.model_file(REPO / "configs" / "x.py", path.stem)
        assert layer.keys["preset"] in PRESETS, path
        assert set(layer.keys) <= set(C.base_config().model.keys()), path


# ---- (c) docs/spec.md §2 in the resolved Qwen3-8B config ----

def test_qwen3_8b_has_the_papers_values():
    c = cfg_file("qwen3_8b")
    assert (c.train.prompts_per_step, c.train.group_size) == (32, 16)
    assert c.rollout.max_turns == 10
    assert (c.rollout.max_prompt_tokens, c.rollout.max_response_tokens) == (10_000, 13_000)
    assert c.optim.lr == 1e-6
    assert c.train.mini_batches == 1
    assert c.rollout.temperature == 1.0
    assert c.loss.kl_coef == 0.0
    assert c.eval.every == 5 and c.checkpoint.every == 5
    assert (c.rl.method, c.rl.base) == ("turnsight", "matchtir")
    assert (c.rl.lam, c.rl.eps_w) == (0.5, 0.5)
    assert tuple(c.rl.depths) == (1, 2, 3)
    assert c.rollout.enable_thinking is True
    assert (c.data.source, c.data.eval_source) == ("ftrl", "ftrl")
    assert c.model.preset == "qwen3-8b" and not c.model.allow_random_init
    assert c.train.steps == 207  # 3 epochs x floor(2215 / 32): verl's drop_last, as the released trainer counts
    step_cfg, method = C.validate(c, 8, check_data=False)
    assert step_cfg.algo.method == "turnsight" and step_cfg.algo.base == "matchtir"
    assert method is not None


# ---- (d) the model layer's architecture is not overridable ----

def test_architecture_override_is_refused():
    with pytest.raises(ConfigError) as e:
        C.load_run_config(str(REPO / "configs/qwen3_8b.py"), ["--config.model.preset=qwen3-4b"])
    msg = str(e.value)
    assert "\n" not in msg
    for part in ("model.preset", "'qwen3-8b'", "qwen3-4b", "configs/models/qwen3_8b.py", "use a config with that model"):
        assert part in msg, msg
    with pytest.raises(ConfigError, match="fixes model.preset='tiny-default'"):
        C.load_run_config(None, ["--config.model.preset=tiny"])
    with pytest.raises(ConfigError, match="fixes model.preset"):
        C.load_run_config(str(REPO / "configs/qwen3_8b.py"), ["--config.model.preset="])


def test_memory_knobs_and_weights_stay_overridable():
    c = C.load_run_config(str(REPO / "configs/qwen3_8b.py"), [
        "--config.model.preset=qwen3-8b",  # the same value: no conflict
        "--config.model.remat=False", "--config.model.attn_q_chunk=512", "--config.model.compute_dtype=float32",
        "--config.model.ref_dtype=float32", "--config.model.hf_path=/ckpt/Qwen3-8B"])
    assert (c.model.remat, c.model.attn_q_chunk, c.model.compute_dtype, c.model.hf_path) == (
        False, 512, "float32", "/ckpt/Qwen3-8B")


def test_layers_guard_their_scope():
    with pytest.raises(ConfigError, match=r"'lr' is not a model\.\* key"):
        C.layered(model=C.ModelLayer("m.py", {"preset": "tiny", "lr": 1e-3}))

    def sets_preset(c):
        c.model.preset = "qwen3-4b"

    with pytest.raises(ConfigError, match="the experiment changed model.preset"):
        C.layered(model=C.ModelLayer("m.py", {"preset": "qwen3-8b"}), experiment=sets_preset)


def test_hf_folder_of_another_architecture_is_named(tmp_path):
    from turnsight_jax import model_setup

    folder = tmp_path / "Qwen3-4B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(PRESETS["qwen3-4b"].to_hf_dict()))
    cfg = C.load_run_config(str(REPO / "configs/qwen3_8b.py"), [f"--config.model.hf_path={folder}"])
    msg = model_setup.architecture_mismatch(cfg, model_setup.model_config(cfg))
    assert "model.preset='qwen3-8b'" in msg and "configs/models/qwen3_8b.py" in msg, msg
    assert "hidden_size 2560 (preset 4096)" in msg and "num_layers" not in msg, msg  # 36 layers in both
    same = C.load_run_config(str(REPO / "configs/qwen3_4b.py"), [f"--config.model.hf_path={folder}"])
    assert model_setup.architecture_mismatch(same, model_setup.model_config(same)) is None


# ---- (e) overrides and validation, in process ----

def test_unknown_key_names_the_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'rl.lamda'; did you mean rl.lam"):
        C.load_run_config(None, ["--config.rl.lamda=0.3"])
    with pytest.raises(ConfigError, match=r"unknown argument 'rl.lam=0.3'"):
        C.load_run_config(None, ["rl.lam=0.3"])
    with pytest.raises(ConfigError, match="must look like --config.key=value"):
        C.load_run_config(None, ["--config.rl.lam"])


def test_bad_type_is_refused():
    with pytest.raises(ConfigError, match=r"--config.train.steps: expected int, got 'ten'"):
        C.load_run_config(None, ["--config.train.steps=ten"])
    with pytest.raises(ConfigError, match=r"--config.model.remat: expected a bool"):
        C.load_run_config(None, ["--config.model.remat=3"])
    c = C.load_run_config(None, ["--config.optim.lr=1", "--config.rl.depths=2", "--config.rl.selection=1"])
    assert c.optim.lr == 1.0 and isinstance(c.optim.lr, float) and tuple(c.rl.depths) == (2,) and c.rl.selection == 1


def test_plugin_method_args_are_free_form():
    c = C.load_run_config(None, ["--config.rl.args.beta=0.25", "--config.rl.args.mode=fast"])
    step_cfg, _ = C.validate(c, 1)
    assert step_cfg.algo.arg("beta") == 0.25 and step_cfg.algo.arg("mode") == "fast"


def test_validate_returns_step_config_and_method():
    step_cfg, method = C.validate(C.default_config(), 1)
    assert step_cfg.algo.method == "turnsight" and step_cfg.algo.base == "grpo"
    assert step_cfg.group_size == 4 and step_cfg.max_turns == 4
    assert method is not None
    with pytest.raises(ConfigError, match="rl.eps_w must be in"):
        C.validate(C.load_run_config(None, ["--config.rl.eps_w=1.0"]), 1)
    with pytest.raises(ConfigError, match="does not divide 1 devices"):
        C.validate(C.load_run_config(None, ["--config.mesh.fsdp=3"]), 1)
    with pytest.raises(ConfigError, match=r"must split into 1 mini-batches of 3 equal micro-batches"):
        C.validate(C.load_run_config(None, ["--config.train.micro_batches=3"]), 1)


def test_matchtir_and_toolrl_keys_are_validated():
    c = C.load_run_config(None, ["--config.rl.matchtir_matching=greedy", "--config.rl.matchtir_semantics=released",
                                 "--config.rl.matchtir_singleton=raw", "--config.rl.toolrl_format=False"])
    algo = C.validate(c, 1)[0].algo
    assert (algo.matchtir_matching, algo.matchtir_semantics, algo.matchtir_singleton, algo.toolrl_format) == (
        "greedy", "released", "raw", False)
    for key, value, allowed in (("matchtir_matching", "hungarian", r"\('greedy', 'assignment', 'transport'\)"),
                                ("matchtir_semantics", "paper", r"\('clean', 'released'\)"),
                                ("matchtir_singleton", "one", r"\('zero', 'raw'\)")):
        with pytest.raises(ConfigError, match=rf"rl.{key} must be one of {allowed}, got '{value}'"):
            C.validate(C.load_run_config(None, [f"--config.rl.{key}={value}"]), 1)


def test_reward_inputs_must_come_from_the_training_source():
    def cfg(method, base, source):
        return C.load_run_config(None, [f"--config.rl.method={method}", f"--config.rl.base={base}",
                                        f"--config.data.source={source}", "--config.data.path=/data/train.json"])

    with pytest.raises(ConfigError, match=r"rl.method='matchtir': reward matchtir_turns needs Task.gold_calls, "
                                          r"which data.source='toolhop' does not provide \(sources that do: "
                                          r"builtin, ftrl\)"):
        C.validate(cfg("matchtir", "grpo", "toolhop"), 1)
    with pytest.raises(ConfigError, match=r"rl.method='turnsight' over rl.base='matchtir': reward matchtir_turns"):
        C.validate(cfg("turnsight", "matchtir", "toolhop"), 1)
    with pytest.raises(ConfigError, match=r"rl.method='toolrl': reward toolrl needs Task.gold_calls"):
        C.validate(cfg("toolrl", "grpo", "toolhop"), 1)
    # BFCL cannot be trained on at all (its own error, first).
    with pytest.raises(ConfigError, match=r"data.source must be one of builtin, ftrl, toolhop, got 'bfcl'"):
        C.validate(cfg("matchtir", "grpo", "bfcl"), 1)
    # Sources that provide gold calls, and methods that need none, pass.
    for method, base, source in (("matchtir", "grpo", "ftrl"), ("turnsight", "matchtir", "builtin"),
                                 ("toolrl", "grpo", "ftrl"), ("grpo", "grpo", "toolhop"),
                                 ("turnsight", "grpo", "toolhop")):
        C.validate(cfg(method, base, source), 1)


def test_toolrl_config_resolves_and_validates():
    c = cfg_file("methods/toolrl")
    step_cfg, method = C.validate(c, 1)
    assert method.name == "toolrl" and [r.name for r in method.rewards] == ["toolrl"]
    assert method.advantage.name == "grpo" and method.base is None
    assert [t.name for t in method.loss_terms] == ["clipped_surrogate"]
    assert step_cfg.algo.toolrl_format is True
    # The tiny CPU experiment otherwise: same model layer, data and warm-start, a shorter schedule.
    diff = {k for k, v in flat(c.to_dict()).items() if flat(C.default_config().to_dict())[k] != v}
    assert diff == {"name", "rl.method", "train.steps", "data.num_eval"}
    assert (c.data.source, c.train.steps, c.data.num_eval) == ("builtin", 8, 32)


def test_released_code_switches_translate_and_validate():
    """The issue-18 switches reach the typed configs; each bad value is a one-line ConfigError."""
    c = C.load_run_config(None, ["--config.loss.clip_ratio_c=3.0", "--config.loss.entropy_coef=0.001",
                                 "--config.rl.norm_pool=token_gap", "--config.rl.uncovered_in_stats=false",
                                 "--config.rl.student_sees_observations=false",
                                 "--config.rl.hindsight_template.item=[{turn}] {calls}{results}",
                                 "--config.rollout.end_on_unparsable_turn=true", "--config.rollout.calls_in_think=true"])
    step_cfg, method = C.validate(c, 1)
    assert (step_cfg.loss.clip_ratio_c, step_cfg.loss.entropy_coef) == (3.0, 0.001)
    a = step_cfg.algo
    assert (a.norm_pool, a.uncovered_in_stats, a.student_sees_observations) == ("token_gap", False, False)
    assert a.hindsight_template.item == "[{turn}] {calls}{results}"
    assert a.hindsight_template.call == "<tool_call>\n{call}\n</tool_call>\n"  # the other pieces keep their defaults
    assert [t.name for t in method.loss_terms] == ["clipped_surrogate", "entropy"]  # added because the coef > 0
    rc = C.rollout_config(c)
    assert rc.end_on_unparsable_turn and rc.calls_in_think
    for override, message in [
        ("loss.clip_ratio_c=1.0", r"loss.clip_ratio_c must be None \(off\) or > 1, got 1.0"),
        ("loss.entropy_coef=-0.1", "loss.entropy_coef must be finite and >= 0"),
        ("rl.norm_pool=tokens", r"rl.norm_pool must be one of \('turn_mean', 'token_gap', 'per_turn'\), got 'tokens'"),
        ("rl.empty_block_turns=dropped", r"rl.empty_block_turns must be one of \('weighted', 'excluded'\)"),
        ("rl.hindsight_template.result=<r>{result}{gold}</r>",
         r"rl.hindsight_template.result: unknown field \{gold\}; allowed: \{result\}"),
        ("rl.hindsight_template.message_open={", r"rl.hindsight_template.message_open: not a format string"),
    ]:
        with pytest.raises(ConfigError, match=message) as e:
            C.validate(C.load_run_config(None, ["--config." + override]), 1)
        assert "\n" not in str(e.value)
    c = C.default_config()
    c.rl.hindsight_template.footer = "x"  # a config file adding a piece the message does not have
    with pytest.raises(ConfigError, match="rl.hindsight_template.footer is not a piece of the hindsight message"):
        C.validate(c, 1)


def test_a_config_file_missing_sections_or_keys_is_one_line(tmp_path):
    """A hand-written get_config() without a whole section (or a key) is named in one ConfigError
    at load time, not an AttributeError deep in the run."""
    path = tmp_path / "partial.py"
    path.write_text("from turnsight_jax.config import default_config\n\n"
                    "def get_config():\n    c = default_config()\n    del c['train']\n    del c.loss['kl_coef']\n"
                    "    return c\n")
    with pytest.raises(ConfigError) as e:
        C.load_config_file(path)
    msg = str(e.value)
    assert "\n" not in msg and "lacks key 'loss.kl_coef', section 'train'" in msg, msg
    assert C.load_config_file(C.pathlib.Path(C.__file__).parents[1] / "configs" / "qwen3_8b.py").train.steps > 0


def test_a_config_file_setting_a_key_that_is_none_is_one_line(tmp_path):
    """A key the base config lacks (a typo, or a key that moved to a method's own section) would
    be read by nothing: named at load time, with the key it most likely meant; free-form rl.args
    keys stay free."""
    path = tmp_path / "moved.py"
    path.write_text("from turnsight_jax.config import default_config\n\n"
                    "def get_config():\n    c = default_config()\n    c.rl.toolomni_gate = 0.9\n"
                    "    c.train.stepz = 3\n    c.rl.args.my_knob = 2\n    return c\n")
    with pytest.raises(ConfigError) as e:
        C.load_config_file(path)
    msg = str(e.value)
    assert "\n" not in msg and "sets 'rl.toolomni_gate', which is no config key; did you mean toolomni.gate" in msg, msg
    assert "(and 1 more: train.stepz)" in msg and "my_knob" not in msg, msg
    path.write_text("from turnsight_jax.config import default_config\n\n"
                    "def get_config():\n    c = default_config()\n    c.toolomni.gate = 0.9\n"
                    "    c.rl.args.my_knob = 2\n    return c\n")
    assert C.load_config_file(path).toolomni.gate == 0.9


@pytest.mark.parametrize("override,message", [
    ("rl.hindsight_budget=-1", r"rl.hindsight_budget must be an int >= 0 \(tokens per block; 0: off\), got -1"),
    ("rl.hindsight_filler=''", r"rl.hindsight_filler must be a non-empty string"),
    ("privileged.block_budget=-5", r"privileged.block_budget must be an int >= 0"),
    ("rl.selection=adaptive", r"rl.selection must be one of \('vote', 'mean', 'dependency', 'saturation'\)"),
    ("rl.horizon_tol=-0.1", r"rl.horizon_tol must be a finite number >= 0"),
    ("faults.wrong_rate=1.5", r"faults.wrong_rate must be a probability in \[0, 1\], got 1.5"),
    ("faults.unavailable_attempts=0", r"faults.unavailable_attempts must be an int >= 1, got 0"),
    ("faults.delay_s=-1.0", r"faults.delay_s must be a finite number of seconds >= 0"),
    ("data.max_hops=1", r"data: SyntheticConfig.max_hops must be 0 \(off\) or >= hops=2, got 1"),
    ("data.max_hops=25", r"data: SyntheticConfig: max_hops \+ max_distractors must be <= num_relations=4"),
    ("data.min_result_words=9", r"data: SyntheticConfig: need 0 <= min_result_words <= max_result_words, got 9, 0"),
])
def test_study_keys_are_validated(override, message):
    """The keys of docs/experiments.md's studies: a bad value is a one-line ConfigError naming it."""
    cfg = C.apply_overrides(C.default_config(), [override])
    with pytest.raises(ConfigError, match=message):
        C.validate(cfg, 1)


def test_study_keys_accept_their_values():
    for good in (["rl.hindsight_budget=96"], ["rl.selection=dependency"], ["rl.selection=saturation"],
                 ["faults.wrong_rate=0.2"], ["data.max_hops=3", "data.vocab_size=12"]):
        C.validate(C.apply_overrides(C.default_config(), good), 1)


def test_turn_coverage_accepts_ascii_counts_only():
    """rl.turns: "all", "first:N" or "last:N"; a count in other digits ("²": str.isdigit() is true,
    int() fails) is the same ConfigError as any bad value, not a ValueError from int()."""
    from turnsight_jax.rl.config import parse_turn_coverage

    assert parse_turn_coverage("all") == ("all", 0)
    assert parse_turn_coverage("first:5") == ("first", 5) and parse_turn_coverage("last:12") == ("last", 12)
    for bad in ("first:²", "last:٣", "first:0", "first:", "middle:2", "last:-1"):
        with pytest.raises(ConfigError, match="turns must be 'all', 'first:N' or 'last:N'"):
            parse_turn_coverage(bad)


def test_a_privileged_teachers_skills_file_is_checked_when_it_is_read(tmp_path):
    """privileged.skills is read at validation when a stage's privileged teacher shows skills (SDAR:
    privileged.source=skill), and a missing or malformed file is one ConfigError naming the key; a
    run whose teacher shows no skills never reads it (the check belongs to the self-distillation
    methods, registered with rl.methods.register_config_check)."""
    sdar = [str(REPO / "configs" / "methods" / "sdar.py")]
    bad = tmp_path / "skills.json"
    bad.write_text("{not json")
    for path, message in ((tmp_path / "absent.json", "privileged.skills: "), (bad, "privileged.skills: ")):
        with pytest.raises(ConfigError, match=message):
            C.validate(C.load_run_config(sdar[0], [f"--config.privileged.skills={path}"]), 1)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"default": "Check every hop before answering."}))
    C.validate(C.load_run_config(sdar[0], [f"--config.privileged.skills={good}"]), 1)
    C.validate(C.load_run_config(None, [f"--config.privileged.skills={tmp_path / 'absent.json'}"]), 1)  # not read
