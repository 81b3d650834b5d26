"""The tunix side of benchmarks/peers.py. Runs in its own virtual environment (google-tunix pins
safetensors<0.8, which ours does not allow), so it imports nothing from turnsight_jax.

    <tunix venv>/bin/python benchmarks/_peers_tunix.py WORK_DIR

Reads WORK_DIR/model (a Hugging Face Qwen3 folder), WORK_DIR/tokenizer, WORK_DIR/inputs.npz and
WORK_DIR/settings.json (written by peers.py); writes WORK_DIR/tunix.npz (outputs to check) and
WORK_DIR/tunix.json (timings and versions). Every case goes through tunix's public API:

1. log-probs: `tunix.rl.common.compute_per_token_logps` (what its GRPO learner calls for the
   old/reference log-probs), prompt left-padded as tunix expects, completion right-padded;
2. decode: `tunix.generate.sampler.Sampler`, greedy (temperature 0), the prompts as strings
   through its tokenizer adapter, an EOS id that never occurs so every row decodes N tokens;
   once for the tokens only, once with `return_logprobs=True` (what a rollout records);
3. GRPO update: `tunix.rl.algo_core.grpo_loss_fn` (the registered "grpo" policy loss) as the
   loss of a `tunix.sft.peft_trainer.PeftTrainer`, one jitted train step (its
   `jit_train_and_eval_step`): value_and_grad, then `nnx.Optimizer.update` with the same optax
   chain (global-norm clip, AdamW) ours uses.
"""

from __future__ import annotations

import functools
import json
import pathlib
import statistics
import sys
import time


def median_time(fn, repeats: int, warmup: int = 1) -> float:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def tunix_config(hf: dict):
    from tunix.models.qwen3 import model as qmodel

    return qmodel.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"], rope_theta=int(hf["rope_theta"]), norm_eps=hf["rms_norm_eps"],
        use_tied_embedding=bool(hf.get("tie_word_embeddings", False)))


def main(work: pathlib.Path) -> None:
    import importlib.metadata as md

    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from transformers import AutoTokenizer
    from tunix.generate import sampler as tsampler
    from tunix.models.qwen3 import params as qparams
    from tunix.rl import algo_core, common
    from tunix.rl.grpo.grpo_learner import GRPOConfig
    from tunix.sft import peft_trainer

    settings = json.loads((work / "settings.json").read_text())
    x = dict(np.load(work / "inputs.npz"))
    repeats = settings["repeats"]
    hf = json.loads((work / "model" / "config.json").read_text())
    cfg = tunix_config(hf)
    load = lambda: qparams.create_model_from_safe_tensors(str(work / "model"), cfg, mesh=None, dtype=jnp.float32)
    out, times = {}, {}

    # 1. teacher-forced log-probs of the completion tokens
    model = load()
    graphdef, state = nnx.split(model)
    pad, eos = settings["pad_id"], settings["eos_id"]
    lp_fn = lambda: common.compute_per_token_logps(graphdef, state, jnp.asarray(x["lp_prompt"]),
                                                   jnp.asarray(x["lp_completion"]), pad, eos, stop_gradient=True)
    out["lp"] = np.asarray(lp_fn())
    times["logprobs"] = median_time(lp_fn, repeats)
    print(f"tunix: log-probs {times['logprobs'] * 1e3:.0f} ms", flush=True)

    # 2. greedy decode
    tok = AutoTokenizer.from_pretrained(str(work / "tokenizer"))
    prompts = json.loads((work / "prompts.json").read_text())
    n_new = settings["decode_new_tokens"]
    longest = int(x["dec_prompt_lens"].max())
    sampler = tsampler.Sampler(model, tok, tsampler.CacheConfig(cache_size=longest + n_new + 8,
                                                                num_layers=cfg.num_layers,
                                                                num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))

    def decode(logprobs: bool = False):
        return sampler(prompts, max_generation_steps=n_new, max_prompt_length=longest, temperature=0.0,
                       eos_tokens=[-1], return_logprobs=logprobs)

    res = decode()
    out["dec_tokens"] = np.stack([np.asarray(t)[:n_new] for t in res.tokens]).astype(np.int32)
    out["dec_prompt_ids"] = np.asarray(res.padded_prompt_tokens, np.int32)
    times["decode"] = median_time(decode, repeats, warmup=0)
    print(f"tunix: decode {times['decode'] * 1e3:.0f} ms", flush=True)
    res = decode(True)
    out["dec_lp_tokens"] = np.stack([np.asarray(t)[:n_new] for t in res.tokens]).astype(np.int32)
    out["dec_logprobs"] = np.stack([np.asarray(lp, np.float32)[:n_new] for lp in res.logprobs])
    times["decode_logprobs"] = median_time(lambda: decode(True), repeats, warmup=0)
    print(f"tunix: decode with log-probs {times['decode_logprobs'] * 1e3:.0f} ms", flush=True)
    del sampler

    # 3. one GRPO update (fresh model: the decode above must not have touched it, but be sure)
    model = load()
    s = settings["grpo"]
    algo = GRPOConfig(beta=0.0, epsilon=s["clip_eps"], loss_agg_mode="sequence-mean-token-mean",
                      num_generations=s["group_size"])
    algo.temperature = 1.0  # GRPOLearner copies it from the rollout config; the loss reads it
    tx = optax.chain(optax.clip_by_global_norm(s["max_grad_norm"]),
                     optax.adamw(s["lr"], b1=s["b1"], b2=s["b2"], weight_decay=s["weight_decay"]))
    trainer = peft_trainer.PeftTrainer(model, tx, peft_trainer.TrainingConfig(eval_every_n_steps=10**9))
    loss_fn = functools.partial(algo_core.grpo_loss_fn, algo_config=algo, pad_id=pad, eos_id=eos)
    trainer.with_loss_fn(lambda m, train_example: loss_fn(m, train_example), has_aux=True)
    train_step, _ = trainer.jit_train_and_eval_step()
    example = common.TrainExample(
        prompt_ids=jnp.asarray(x["rl_prompt"]), prompt_mask=jnp.asarray(x["rl_prompt"] != pad),
        completion_ids=jnp.asarray(x["rl_completion"]), completion_mask=jnp.asarray(x["rl_mask"], jnp.int32),
        advantages=jnp.asarray(x["rl_advantages"]), ref_per_token_logps=None,
        old_per_token_logps=jnp.asarray(x["rl_old"]))
    loss, _, grad_norm = train_step({"train_example": example})
    out["rl_loss"], out["rl_grad_norm"] = np.float64(loss), np.float64(grad_norm)
    times["grpo_update"] = median_time(lambda: train_step({"train_example": example})[0], repeats)
    print(f"tunix: GRPO update {times['grpo_update'] * 1e3:.0f} ms", flush=True)

    np.savez(work / "tunix.npz", **out)
    versions = {p: md.version(p) for p in ("google-tunix", "jax", "jaxlib", "flax", "optax")}
    (work / "tunix.json").write_text(json.dumps({"times": times, "versions": versions}, indent=1))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
