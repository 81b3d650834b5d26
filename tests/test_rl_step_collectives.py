"""The compiled fused step on an 8-device FSDP mesh moves no vocabulary-sized activation between
devices: the log-prob chunk loop runs on each device's own rows (rl.logprobs), so the only
collectives with the vocabulary dimension are the head weight's gather and its gradient's
reduce-scatter, once per step, outside every loop. Read from the optimised HLO of the step compiled
on abstract inputs (nothing is allocated)."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.qwen3 import Qwen3, RuntimeOptions
from turnsight_jax.models.sharding import make_mesh, state_shardings
from turnsight_jax.rl.batch import Geometry, abstract_batch, packed_reference
from turnsight_jax.rl.config import AlgoConfig, LossConfig, StepConfig
from turnsight_jax.rl.methods import resolve_method
from turnsight_jax.rl.step import make_optimizer, make_train_step

# A vocabulary no other dimension equals; hidden 64 < the 128-row log-prob chunk, so a [rows, V]
# activation is never mistaken for the [D, V] weight.
VOCAB, HIDDEN, CHUNK = 1000, 64, 128
BLOCK = 96  # model.vocab_block of the blocked cases: 10 blocks and a 40-column remainder (no other dimension is 96)
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_CALLS = re.compile(r"(?:body|condition|to_apply|calls)=%?([\w.\-]+)|branch_computations=\{([^}]*)\}")
_SHAPE = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")


def parse_collectives(hlo: str) -> list[tuple[str, list[tuple[int, ...]], bool]]:
    """(op, result shapes, inside a loop) of every collective in an HLO module's text.

    A computation is inside a loop when a while body or condition calls it, directly or through
    other computations."""
    comps: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m:
            name = m.group(1)
            comps[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            comps[name].append(line)
    callees: dict[str, set[str]] = {c: set() for c in comps}
    loop_roots: set[str] = set()
    for c, lines in comps.items():
        for line in lines:
            for m in _CALLS.finditer(line):
                names = [m.group(1)] if m.group(1) else [n.strip().lstrip("%") for n in m.group(2).split(",")]
                callees[c].update(names)
            if " while(" in line:
                loop_roots.update(re.findall(r"(?:body|condition)=%?([\w.\-]+)", line))
    in_loop, todo = set(), list(loop_roots)
    while todo:
        c = todo.pop()
        if c in in_loop:
            continue
        in_loop.add(c)
        todo.extend(callees.get(c, ()))
    out = []
    for c, lines in comps.items():
        for line in lines:
            if "=" not in line:
                continue
            lhs, rhs = line.split("=", 1)
            op = next((o for o in COLLECTIVES if re.search(rf"\s{o}(-start)?\(", " " + rhs)), None)
            if op is None:
                continue
            result_type = rhs.split(op)[0]
            shapes = [tuple(int(d) for d in s.split(",") if d) for s in _SHAPE.findall(result_type)]
            out.append((op, shapes, c in in_loop))
    return out


def _compiled_hlo(method: str, tied: bool, packed: bool = False, tensor: int = 1, vocab_block: int = 0) -> str:
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, tie_word_embeddings=tied)
    mesh = make_mesh(fsdp=8 // tensor, tensor=tensor)
    step_cfg = StepConfig(algo=AlgoConfig(method=method), loss=LossConfig(kl_coef=0.01), group_size=4, max_turns=4,
                          logprob_chunk=CHUNK, pack_rows=packed)
    m = resolve_method(step_cfg)
    options = RuntimeOptions(vocab_block=vocab_block)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0), options=options)))
    shard = state_shardings(params, mesh)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shard)
    optimizer = make_optimizer(step_cfg.optim)
    opt = jax.eval_shape(optimizer.init, params)
    views = m.teacher_views(step_cfg.algo) + int(packed_reference(step_cfg, m))
    geo = Geometry(batch=16, length=256, policy=192, packed=512, distinct=320, views=views, turns=4,
                   row_shards=8 // tensor, pack_cell=2 if packed else None,  # packed: 16 rows / 8 shards, cells of 2
                   pack_student=(2, 256), pack_teacher=(2, 512))  # one trajectory (hindsight row) per packed row
    batch = abstract_batch(geo, mesh, m)
    step = make_train_step(graphdef, step_cfg, optimizer, m)
    with jax.set_mesh(mesh):
        return step.lower(params, opt, params, batch).compile().as_text()


def _vocab_collectives(hlo: str):
    return [(op, s, loop) for op, shapes, loop in parse_collectives(hlo) for s in shapes if VOCAB in s]


def test_parser_finds_collectives_in_loops():
    """The parser itself: a per-chunk all-reduce inside a scan is seen as in a loop."""
    mesh = make_mesh(fsdp=8)

    def f(x, w):
        def body(c, xc):
            return c, jnp.dot(xc, w)  # rows replicated, contraction sharded: an all-reduce per chunk
        return jax.lax.scan(body, None, x)[1]

    from jax.sharding import NamedSharding, PartitionSpec as P
    x = jax.ShapeDtypeStruct((4, 128, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, None, "fsdp")))
    w = jax.ShapeDtypeStruct((64, VOCAB), jnp.float32, sharding=NamedSharding(mesh, P("fsdp", None)))
    with jax.set_mesh(mesh):
        hlo = jax.jit(f, out_shardings=NamedSharding(mesh, P())).lower(x, w).compile().as_text()
    found = _vocab_collectives(hlo)
    assert any(loop and op == "all-reduce" and s == (128, VOCAB) for op, s, loop in found), found


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 fake devices (tests/conftest.py)")
@pytest.mark.parametrize("method,tied,packed,tensor,vocab_block", [
    ("turnsight", True, False, 1, 0), ("grpo", False, False, 1, 0), ("turnsight", False, True, 1, 0),
    ("sdpo", False, False, 1, 0), ("sdpo", False, False, 4, 0), ("turnsight", True, False, 1, BLOCK),
    ("sdpo", False, False, 4, BLOCK)])
def test_no_vocabulary_sized_collective_in_the_fused_step(method, tied, packed, tensor, vocab_block):
    """packed: rows packed several per row (rl.packing): the per-shard gather from the packed
    rows keeps the head's chunk loop on each device's own rows. sdpo: the teacher's top-K and the
    student's log-probs at those K ids run in the same per-device loops (the K candidates, not
    the vocabulary, are what a tensor-sharded head would gather). vocab_block: the head in
    vocabulary blocks (model.vocab_block): no block of the weight or of its gradient crosses
    devices inside the loops either."""
    hlo = _compiled_hlo(method, tied, packed, tensor, vocab_block)
    found = _vocab_collectives(hlo)
    in_loops = [f for f in found if f[2]]
    assert not in_loops, f"vocabulary-sized collectives inside a loop: {in_loops}"
    if vocab_block:
        blocks = [(op, s) for op, shapes, loop in parse_collectives(hlo) for s in shapes
                  if loop and {BLOCK, (VOCAB // tensor) % BLOCK} & set(s)]  # a block, or the remainder
        assert not blocks, f"vocabulary-block collectives inside a loop: {blocks}"
    # outside loops only the weight itself ([D, V] or an fsdp shard of it) crosses devices
    activations = [f for f in found if math.prod(f[1]) // VOCAB > HIDDEN]
    assert not activations, f"vocabulary-sized activations crossing devices: {activations}"
    weight = [f for f in found if math.prod(f[1]) // VOCAB <= HIDDEN]
    # the head weight's gather(s) and the gradient's reduce-scatter, a handful per step (the
    # embedding table shares the vocabulary dimension and is gathered/reduced the same way)
    assert len(weight) <= 8, weight
