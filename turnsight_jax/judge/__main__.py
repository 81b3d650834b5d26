"""`python -m turnsight_jax.judge label|distill`: a teacher judge labels trajectories; a student
judge is distilled from the labels.

    python -m turnsight_jax.judge label --config configs/methods/judge.py \\
        --config.judge.checkpoint=/path/to/teacher --policy runs/tiny_cpu/export --out labels.jsonl
    python -m turnsight_jax.judge label --teacher verifier --policy demonstrations --out labels.jsonl
    python -m turnsight_jax.judge distill --labels labels.jsonl --student /path/to/small_qwen3 --out judge_small

Both read the run config (`--config FILE`, default the embedded one, and `--config.key=value`
overrides) for the `judge.*` keys (the format: `judge.rationale`; the limits), and `label` for
the tasks (`data.*`) and the rollouts (`rollout.*`). `label --policy` is a Hugging Face Qwen3
folder rolled out on the training tasks at the rollout sampling, or `demonstrations`: no model,
the built-in tasks' demonstrations replayed, correct and spoiled (docs/signal_methods.md). The
teacher is the `judge.checkpoint` model, or `--teacher verifier`: the environment's verifier with
a stated rationale (judge.verifier_teacher), where no large judge is at hand.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

import turnsight_jax.methods  # noqa: F401  (the composition root: the built-in methods register themselves)
from turnsight_jax.errors import ConfigError


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="a configs/*.py file for the judge.* keys (default: the embedded one)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m turnsight_jax.judge", description=__doc__.split("\n\n")[0],
                                 epilog="Overrides: --config.<key>=<value>, e.g. --config.judge.rationale=False")
    sub = ap.add_subparsers(dest="command", required=True)
    lab = sub.add_parser("label", help="the teacher judge (judge.checkpoint) labels rolled-out trajectories")
    _common(lab)
    lab.add_argument("--policy", required=True, help="a Hugging Face Qwen3 folder, or 'demonstrations'")
    lab.add_argument("--out", required=True, help="the labels JSONL to write")
    lab.add_argument("--num-tasks", type=int, default=64, help="training tasks rolled out (the first N)")
    lab.add_argument("--samples", type=int, default=2, help="rollouts per task")
    lab.add_argument("--seed", type=int, default=0)
    lab.add_argument("--teacher", choices=("model", "verifier"), default="model",
                     help="model: the judge.checkpoint judge; verifier: the environment's verifier with a stated "
                          "rationale (a stand-in where no large judge is at hand)")
    lab.add_argument("--demos", default="gold,wrong_answer,no_tools",
                     help="with --policy demonstrations: the behaviours replayed, drawn uniformly")
    dis = sub.add_parser("distill", help="fine-tune a small judge on a labels JSONL")
    _common(dis)
    dis.add_argument("--labels", required=True, help="a labels JSONL (from `label`)")
    dis.add_argument("--out", required=True, help="the Hugging Face folder to write the student to")
    who = dis.add_mutually_exclusive_group(required=True)
    who.add_argument("--student", help="the student's starting weights: a Hugging Face Qwen3 folder")
    who.add_argument("--student-preset", help="or a Qwen3 preset initialised at random (tests, e.g. 'tiny')")
    dis.add_argument("--steps", type=int, default=200)
    dis.add_argument("--lr", type=float, default=1e-5)
    dis.add_argument("--batch-size", type=int, default=8)
    dis.add_argument("--holdout", type=float, default=0.2, help="share of the rows held out for before/after")
    dis.add_argument("--seed", type=int, default=0)
    return ap


def label_main(args, cfg) -> dict:
    from turnsight_jax import sources
    from turnsight_jax.judge import prompt as judge_prompt
    from turnsight_jax.judge.labels import LabelRow, rows_from_judgments, write_labels
    from turnsight_jax.judge.model import Judge
    from turnsight_jax.judge.rollouts import policy_rollouts
    from turnsight_jax.judge.settings import judge_settings
    from turnsight_jax.judge.verifier_teacher import verifier_judgment

    settings = judge_settings(cfg.judge, need_checkpoint=args.teacher == "model")
    if args.num_tasks < 1 or args.samples < 1:
        raise ConfigError(f"--num-tasks and --samples must be >= 1, got {args.num_tasks} and {args.samples}")
    tasks = sources.load_tasks(cfg, "train")[: args.num_tasks]
    trajs, row_tasks = policy_rollouts(cfg, args.policy, tasks, args.samples, seed=args.seed,
                                       kinds=tuple(k.strip() for k in args.demos.split(",") if k.strip()))
    users = [judge_prompt.user_text(task, traj, reference=settings.reference) for traj, task in zip(trajs, row_tasks)]
    cost = {}
    if args.teacher == "model":
        judge = Judge.load(settings)
        judgments = judge.judge_users(users)
        rows = rows_from_judgments(users, judgments, verifier_rewards=[t.reward for t in trajs],
                                   task_ids=[t.task_id for t in row_tasks])
        cost = {"generated_tokens": int(sum(j.generated_tokens for j in judgments)), "judge_s": round(judge.seconds, 2)}
    else:
        rows = []
        for u, traj, task in zip(users, trajs, row_tasks):
            rationale, label = verifier_judgment(traj, settings.verifier_threshold)
            rows.append(LabelRow(u, label, rationale, False, judge_prompt.target_text(rationale, label, with_rationale=True),
                                 float(traj.reward), str(task.task_id)))
    path = write_labels(args.out, rows)
    ok = np.array([t.reward >= settings.verifier_threshold for t in trajs])
    labels = np.array([r.label for r in rows])
    return {"labels": str(path), "rows": len(rows), "teacher": args.teacher, "positive_rate": float(labels.mean()),
            "malformed_rate": float(np.mean([r.malformed for r in rows])),
            "agreement_with_verifier": float(np.mean(labels == ok)), **cost}


def distill_main(args, cfg) -> dict:
    import jax.numpy as jnp
    from flax import nnx

    from turnsight_jax.assets import default_tokenizer_dir
    from turnsight_jax.chat.tokenizer import check_vocab_fits, load_tokenizer
    from turnsight_jax.judge.distill import DistillConfig, distill, save_judge
    from turnsight_jax.judge.labels import read_labels
    from turnsight_jax.judge.settings import judge_settings
    from turnsight_jax.model_setup import tokenizer_folder
    from turnsight_jax.models.config import get_preset
    from turnsight_jax.models.qwen3 import Qwen3
    from turnsight_jax.models.weights import load_pretrained

    settings = judge_settings(cfg.judge)
    dcfg = DistillConfig(steps=args.steps, lr=args.lr, batch_size=args.batch_size, holdout=args.holdout, seed=args.seed)
    rows = read_labels(args.labels)  # a bad file fails before any model is built
    if args.student:
        model = load_pretrained(args.student, dtype=jnp.float32)
        tokdir = tokenizer_folder(None, args.student)
    else:
        try:
            qcfg = get_preset(args.student_preset)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        model = Qwen3(qcfg, rngs=nnx.Rngs(args.seed), param_dtype=jnp.float32)
        tokdir = default_tokenizer_dir()
    tok = load_tokenizer(tokdir)
    check_vocab_fits(tok, model.config.vocab_size)
    graphdef, params = nnx.split(model)
    params, summary = distill(graphdef, params, tok, rows, settings, dcfg, source=args.labels)
    summary.update(labels=str(args.labels), student=args.student or f"preset {args.student_preset} (random)")
    out = save_judge(graphdef, params, args.out, pathlib.Path(tokdir), summary)
    return {"out": str(out), **{k: summary[k] for k in ("before", "after", "train_rows", "heldout_rows",
                                                         "malformed_rows_left_out", "rationale")}}


def main(argv=None) -> int:
    args, rest = _parser().parse_known_args(argv)
    from turnsight_jax.config import load_run_config

    try:
        cfg = load_run_config(args.config, rest)
        summary = label_main(args, cfg) if args.command == "label" else distill_main(args, cfg)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
