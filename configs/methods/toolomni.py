"""ToolOmni (turnsight_jax.methods.toolomni; docs/signal_methods.md) on the tiny CPU experiment: the
tool turns and the answer turn trained as two separately normalised stages. The tool turns'
reward is R_ret = InfoRecall x AnswerTran + 0.2 format (the gold sub-answers found in the tool
results, times the order agreement of the called tools with the gold chain, plus well-formed
output); the answer turn's is the answer's token F1, normalised among the siblings whose R_ret
passed toolomni.gate.

    python -m turnsight_jax.train --config configs/methods/toolomni.py --workdir /tmp/toolomni_run

Metrics: toolomni/gate_pass_rate, toolomni/retrieval_reward_mean, toolomni/info_recall_mean,
toolomni/answer_tran_mean, toolomni/answer_reward_passed_mean, toolomni/answer_token_frac.
"""

from turnsight_jax.config import default_config


def get_config():
    c = default_config()
    c.name = "toolomni_tiny"
    c.rl.method = "toolomni"
    c.toolomni.gate = 0.95
    c.train.steps = 8
    c.data.num_eval = 32
    return c
