"""SLIM's registration: the skill library in the sampled prompts (the "slim" rollout controller,
the trainer's library in `RolloutContext.state`) and the method, whose rewards and advantage are the
base method's (rl.base, GRPO by default)."""

from __future__ import annotations

from typing import Sequence

from turnsight_jax.chat.types import Task
from turnsight_jax.errors import ConfigError
from turnsight_jax.methods.slim.library import SkillLibrary, SlimConfig, check_writer, slim_settings
from turnsight_jax.methods.slim import report as slim_report
from turnsight_jax.methods.slim.runner import LIBRARY_FILE, SlimRunner
from turnsight_jax.methods.slim.text import with_skills
from turnsight_jax.rl.methods import (Method, ReportSection, RolloutContext, TrainerHookStart, register_config_section,
                                     register_method, register_progress_metrics, register_report_section, register_rollout,
                                     runs_controller, sampler_rollout)
from turnsight_jax.rollout.driver import RolloutResult


def _check_section(cfg, stages, check_data: bool) -> None:
    """SLIM's keys, and its writer's vocabulary (a writer folder is read only when data is checked)."""
    if not runs_controller(stages, "slim"):
        return
    settings = slim_settings(cfg.slim)
    if settings.writer and check_data:
        from turnsight_jax.models.config import Qwen3Config, get_preset

        try:
            policy = Qwen3Config.from_pretrained(cfg.model.hf_path) if cfg.model.hf_path else get_preset(cfg.model.preset)
        except (OSError, ValueError) as e:
            raise ConfigError(str(e)) from None
        check_writer(settings, policy.vocab_size)


register_config_section("slim", SlimConfig, _check_section)


def _start_library(start: TrainerHookStart) -> SlimRunner:
    """The run's skill library (methods.slim.runner): the one saved with the checkpoint the run
    resumes from, else `slim.initial`; audited and expanded after the slim stage's steps."""
    cfg = start.run_config
    return SlimRunner.start(cfg, slim_settings(cfg.slim), start.tokenizer, start.train_tasks, start.workdir, start.mesh,
                            vocab_size=start.vocab_size, resume_text=start.checkpoint_file(LIBRARY_FILE), log=start.log)


@register_rollout("slim", trainer_hook=_start_library)
def slim_rollout(ctx: RolloutContext, tasks: Sequence[Task], seed: int) -> RolloutResult:
    """The default sampler on the tasks with the library's active skills in their prompts
    (methods.slim.text.with_skills; the library is the trainer's, `ctx.state`)."""
    if not isinstance(ctx.state, SkillLibrary):
        raise ValueError("the 'slim' rollout controller needs the trainer's skill library as ctx.state "
                         f"(methods.slim.library.SkillLibrary), got {type(ctx.state).__name__}")
    return sampler_rollout(ctx, [with_skills(t, ctx.state) for t in tasks], seed)


register_method(Method("slim", advantage="base", rewards=(), rollout="slim",
                       description="SLIM: a skill library in the prompt, audited by leave-one-out, retired and expanded"))

register_progress_metrics({"slim/library_size": "skills"})

register_report_section(ReportSection("slim", slim_report.slim_section, plot_name=slim_report.PLOT,
                                      plot_keys=slim_report.COUNTER_KEYS, plot=slim_report.plot))
