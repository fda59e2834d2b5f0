"""jax.vmap of every public JAX op: one launch on folded arrays (adapters/jax/_vmap.py),
bitwise equal to stacking per-example calls of the un-vmapped op."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import adapters.jax as aj
from core_kernels.blocksparse_attention import build_sparse_layout
from harness import poison_like, rng
from test_blocksparse_attention import make_batch
from test_lightning_attention import make_decode, make_prefill
from test_lightning_varlen import make_varlen
from test_merge_attn_states import make_inputs
from test_prefix_prefill import ARRAYS, make_case

V = 2  # examples per vmapped axis


# ------------------------------------------------------------------ op cases
# Each case: (function of positional arrays, example(seed) -> tuple of numpy arrays).
def _merge_example(seed):
    return make_inputs(5, 2, 16, "float32", seed)


def _merge_count_example(seed):
    return make_inputs(5, 2, 16, "float32", seed) + (np.int32(rng(seed).integers(0, 6)),)


def _mask_example(seed):
    g = rng(seed)
    lse = g.standard_normal((2, 7)).astype(np.float32)
    qsl = np.array([0, 2, 2, 6], np.int32) if seed % 2 else np.array([1, 3, 4, 7], np.int32)
    csl = np.cumsum(np.concatenate([[g.integers(0, 3)], g.integers(0, 2, 3)])).astype(np.int32)
    return lse, qsl, csl


def _lightning_example(seed):
    q, k, v, ed, kvh = make_prefill(1, 2, 20, 16, 16, "float32", seed=seed)
    return q, k, v, ed, kvh


def _decode_example(seed):
    q, k, v, cache, slope = make_decode(3, 2, 16, 4, "float32", seed)
    return q, k, v, cache, slope, rng(seed).permutation(np.array([3, -1, 0], np.int32))


def _varlen_example(seed):
    lens = [5, 3] if seed % 2 else [1, 7]
    q, k, v, ed, cu, cache = make_varlen(lens, 2, 16, 16, "float32", num_slots=3, seed=seed)
    return q, k, v, ed, cu, cache, rng(seed).permutation(np.array([2, -1], np.int32))


_LAYOUT = build_sparse_layout(4, 32, 16, 1, 2, False)[0]


def _blocksparse_example(seed):
    q, k, v, cu_k, _ = make_batch([12, 9], [12, 9], 4, 2, 16, "float32", seed)
    return q, k, v, cu_k, *(np.asarray(x) for x in _LAYOUT)


def _blocksparse(q, k, v, cu, crow, col):
    return aj.blocksparse_flash_attn_varlen_fwd(q, k, v, cu, cu, 0.25, (crow, col), block_size=16,
                                                max_seqlen=32)


def _packings_example(seed):
    """Two sequences packed differently per example (21 tokens), decode queries too."""
    lens = [12, 9] if seed % 2 else [5, 16]
    q, k, v, cu_k, _ = make_batch(lens, lens, 4, 2, 16, "float32", seed)
    return q, k, v, cu_k, *(np.asarray(x) for x in _LAYOUT), q[:2]


def _blocksparse_packings(q, k, v, cu, crow, col, q_decode):
    """Prefill (cu_seqlens_q = cu_seqlens_k) and decode (one query per sequence)."""
    opts = dict(block_size=16, max_seqlen=32)
    return (aj.blocksparse_flash_attn_varlen_fwd(q, k, v, cu, cu, 0.25, (crow, col), **opts),
            aj.blocksparse_flash_attn_varlen_fwd(q_decode, k, v, cu, None, 0.25, (crow, col), **opts))


def _blocksparse_grads(q, k, v, cu, crow, col, q_decode):
    """(output, dq, dk, dv): the LSE forward and the backward."""
    def loss(q, k, v):
        out = aj.blocksparse_flash_attn_varlen_fwd(q, k, v, cu, cu, 0.25, (crow, col), block_size=16,
                                                   max_seqlen=32)
        return (out ** 2).sum(), out
    grads, out = jax.grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
    return (out, *grads)


def _context_example(seed):
    lens = [(3, 10), (2, 5)] if seed % 2 else [(1, 12), (4, 3)]
    case = make_case(lens, 2, 1, 16, 8, 8, "float32", seed=seed)
    return tuple(case[n] for n in ARRAYS) + (poison_like(case["q"].shape, "float32"),)


def _context(q, k, v, kc, vc, b_loc, b_start, b_len, output):
    return aj.context_attention_fwd(q, k, v, kc, vc, b_loc, b_start, b_len, max_input_len=4,
                                    output=output)


def _unified_example(seed):
    import test_unified_attention as tua
    lens = [(3, 10), (2, 5)] if seed % 2 else [(1, 12), (4, 3)]  # same shapes: T 5, 6 blocks of 8
    case = tua.make_case(lens, 2, 1, 16, 8, "float32", seed=seed, kv="fp8", per_seq_descale=True)
    return tuple(case[n] for n in tua.ARRAYS) + (case["k_descale"], poison_like(case["q"].shape, "float32"))


def _unified(q, k, v, cu, used, table, k_descale, out):
    return aj.unified_attention(q, k, v, cu, used, table, max_seqlen_q=4, max_seqlen_k=13, softmax_scale=0.3,
                                window_size=(9, 0), k_descale=k_descale, v_descale=0.8, out=out)


CASES = {
    "merge": (aj.merge_attn_states, _merge_example),
    "merge_count": (lambda po, pl, so, sl, c: aj.merge_attn_states(
        po, pl, so, sl, prefill_tokens_with_context=c), _merge_count_example),
    "mask": (aj.mask_empty_context_lse, _mask_example),
    "lightning": (lambda q, k, v, ed, kvh: aj.lightning_attention(q, k, v, ed, 8, kv_history=kvh),
                  _lightning_example),
    "decode": (aj.linear_decode_forward_triton, _decode_example),
    "varlen": (lambda q, k, v, ed, cu, cache, slots: aj.lightning_attention_varlen(
        q, k, v, ed, cu, kv_cache=cache, slot_idx=slots), _varlen_example),
    "blocksparse": (_blocksparse, _blocksparse_example),
    "packings": (_blocksparse_packings, _packings_example),
    "packings_grad": (_blocksparse_grads, _packings_example),
    "context": (_context, _context_example),
    "unified": (_unified, _unified_example),
    # arguments one launch takes once (a scale), per-head values with index data
    # batched: one launch per example
    "merge_scale": (lambda po, pl, so, sl, s: aj.merge_attn_states(po, pl, so, sl, output_scale=s),
                    lambda seed: make_inputs(5, 2, 16, "float32", seed)
                    + (np.float32(rng(seed).uniform(0.5, 2.0, (1,))),)),
    "context_alibi": (lambda *a: aj.context_attention_fwd(*a[:8], max_input_len=4, alibi_slopes=a[8]),
                      lambda seed: _context_example(seed)[:8] + (rng(seed).uniform(0.1, 1.0, 2).astype(np.float32),)),
    "varlen_ed": (lambda q, k, v, ed, cu: aj.lightning_attention_varlen(q, k, v, ed, cu),
                  lambda seed: _varlen_example(seed)[:5]),
    "unified_descale": (lambda *a: aj.unified_attention(*a[:6], max_seqlen_q=4, max_seqlen_k=13, softmax_scale=0.3,
                                                        k_descale=0.5, v_descale=0.5, q_descale=a[6]),
                        lambda seed: _unified_example(seed)[:6] + (np.float32(rng(seed).uniform(0.5, 2.0, (1,))),)),
}

# (case, in_axes): a non-zero axis and mixed batched / unbatched sets for every op;
# the second combination of each op folds along its alternative axis where there is one
COMBOS = [
    ("merge", (0, 0, 0, 0)),
    ("merge", (None, 1, 2, None)),
    ("merge_count", (None, None, 1, 0, 0)),
    ("mask", (1, None, None)),
    ("mask", (0, 0, None)),
    ("lightning", (0, 2, None, None, 1)),
    ("lightning", (None, 0, 0, 0, None)),                # ed batched: heads
    ("decode", (0, None, 3, 1, None, None)),
    ("decode", (None, 1, None, 0, None, 0)),             # slot_idx batched: slots
    ("varlen", (1, None, 0, 0, None, 2, None)),
    ("varlen", (None, 0, None, None, 0, None, 0)),       # cu_seqlens / slot_idx batched: tokens
    ("blocksparse", (2, None, 1, None, None, None)),
    ("blocksparse", (None, 0, None, None, 0, 0)),        # layout batched
    ("context", (1, None, 0, None, 2, None, None, None, None)),    # heads
    ("context", (None, 0, None, 0, None, 0, 0, 0, 1)),             # index data batched: tokens
    ("unified", (1, None, None, None, None, None, None, None)),     # q alone: tokens, one shared cache
    ("unified", (None, 0, 1, 0, None, 0, 0, 1)),     # cache, tables, descales batched: blocks offset
    ("decode", (0, None, 3, 1, 0, 0)),                   # slot_idx and slope_rate: heads over the named states
    ("decode", (None, None, None, None, 0, 0)),
    ("packings", (0, None, 0, 0, None, None, 1)),        # cu_seqlens batched: tokens
    ("packings", (None, None, None, 0, None, None, None)),
    ("packings_grad", (None, 0, 0, 0, None, None, None)),  # the LSE forward and the backward: tokens
]
# what no axis folds: one launch per example
LOOPED = [
    ("merge_scale", (None, 0, None, None, 0)),
    ("context_alibi", (None, 0, None, 0, None, 0, 0, 0, 0)),
    ("packings", (0, None, None, 0, 0, 0, None)),         # cu_seqlens and the layout batched
    ("varlen_ed", (None, 0, None, 0, 0)),
    ("unified_descale", (0, None, None, None, None, None, 0)),
]


def _inputs(example, in_axes, size, seed):
    """The batched arguments and, per example, its un-batched arguments."""
    examples = [example(seed + i) for i in range(size)]
    args = tuple(examples[0][i] if a is None else np.stack([e[i] for e in examples], axis=a)
                 for i, a in enumerate(in_axes))
    per = [tuple(examples[0][i] if a is None else e[i] for i, a in enumerate(in_axes))
           for e in examples]
    return args, per


def _stacked(fn, per):
    outs = [fn(*(jnp.asarray(x) for x in p)) for p in per]
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *outs)


def _assert_equal(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape, (g.shape, w.shape)
        np.testing.assert_array_equal(np.asarray(g), w)


def _seed():
    return int(rng().integers(1 << 20))


@pytest.mark.parametrize("name,in_axes", COMBOS, ids=lambda v: str(v).replace(" ", ""))
def test_vmap_matches_per_example_calls(name, in_axes):
    fn, example = CASES[name]
    args, per = _inputs(example, in_axes, V, _seed())
    want = _stacked(fn, per)
    _assert_equal(jax.vmap(fn, in_axes=in_axes)(*map(jnp.asarray, args)), want)


def _launches(fn, example_args) -> int:
    """Custom calls in one un-vmapped call's HLO: one host callback under the
    interpreter, one per kernel launch of the plan on the GPU."""
    return jax.jit(fn).lower(*map(jnp.asarray, example_args)).as_text().count("custom_call")


JIT_COMBOS = [COMBOS[1], COMBOS[2], COMBOS[4], COMBOS[6], COMBOS[8], COMBOS[10], COMBOS[12], COMBOS[14],
              COMBOS[16], COMBOS[17], COMBOS[19]]


@pytest.mark.parametrize("name,in_axes", JIT_COMBOS, ids=lambda v: str(v).replace(" ", ""))
def test_jit_of_vmap_is_one_callback_without_loop(name, in_axes):
    fn, example = CASES[name]
    args, per = _inputs(example, in_axes, V, _seed())
    args = tuple(map(jnp.asarray, args))
    f = jax.jit(jax.vmap(fn, in_axes=in_axes))
    hlo = f.lower(*args).as_text()
    assert hlo.count("custom_call") == _launches(fn, per[0]) and "while" not in hlo, hlo[-3000:]
    _assert_equal(f(*args), _stacked(fn, per))


@pytest.mark.parametrize("name,outer,inner", [
    ("merge", (0, None, 0, 0), (1, None, None, 0)),
    ("decode", (0, 0, 0, None, None, 0), (0, None, 0, 0, None, None)),
    ("context", (0, 0, 0, 0, 0, 0, 0, 0, None), (None, None, None, None, None, None, None, None, 0)),
    ("unified", (0, 0, 0, 0, 0, 0, None, 0), (None, None, None, None, 0, None, 0, 0)),
], ids=["merge", "decode", "context", "unified"])
def test_nested_vmap(name, outer, inner):
    """vmap of vmap: the outer rule folds the inner rule's already folded launch."""
    fn, example = CASES[name]
    seed = _seed()
    inner_in, per_outer = [], []
    for j in range(V):
        args, per = _inputs(example, inner, V, seed + 10 * j)
        inner_in.append(args)
        per_outer.append(per)
    args = tuple(a if outer[i] is None else np.stack([x[i] for x in inner_in], axis=outer[i])
                 for i, a in enumerate(inner_in[0]))
    # an unbatched outer argument is example 0's, for every outer example
    per_outer = [[tuple(p[i] if outer[i] is not None else per_outer[0][k][i] for i in range(len(p)))
                  for k, p in enumerate(per)] for per in per_outer]
    want = jax.tree.map(lambda *xs: np.stack(xs), *[_stacked(fn, per) for per in per_outer])
    f = jax.jit(jax.vmap(jax.vmap(fn, in_axes=inner), in_axes=outer))
    args = tuple(map(jnp.asarray, args))
    hlo = f.lower(*args).as_text()
    assert hlo.count("custom_call") == _launches(fn, per_outer[0][0]) and "while" not in hlo
    _assert_equal(f(*args), want)


def test_keywords_static_args_and_docstrings_survive_the_wrapping():
    assert aj.lightning_attention.__doc__.startswith("Linear attention with per-head decay")
    q, k, v, ed, kvh = _lightning_example(_seed())
    f = jax.jit(aj.lightning_attention, static_argnames=("block_size", "output_final_state_only"))
    got = f(q, k, v, ed, block_size=8, kv_history=kvh, output_final_state_only=True)
    _assert_equal(got, jax.tree.map(np.asarray, aj.lightning_attention(
        q, k, v, ed, 8, kvh, True)))


@pytest.mark.parametrize("name,in_axes", LOOPED, ids=lambda v: str(v).replace(" ", ""))
def test_what_no_axis_folds_runs_one_launch_per_example(name, in_axes):
    """Every argument may be batched: what cannot fold runs per example (a loop of
    launches under jit), bitwise the per-example calls."""
    fn, example = CASES[name]
    args, per = _inputs(example, in_axes, V, _seed())
    args = tuple(map(jnp.asarray, args))
    _assert_equal(jax.vmap(fn, in_axes=in_axes)(*args), _stacked(fn, per))
    hlo = jax.jit(jax.vmap(fn, in_axes=in_axes)).lower(*args).as_text()
    assert "while" in hlo and hlo.count("custom_call") == _launches(fn, per[0])


def test_no_vmap_refusal_is_left():
    """No rule refuses a batched argument (issue 44): the refusal helper is gone."""
    import adapters.jax._vmap as vm
    assert not hasattr(vm, "unsupported")
