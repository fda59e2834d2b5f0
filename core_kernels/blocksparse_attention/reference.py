"""float64 numpy reference for block-sparse varlen attention, written from the spec.

Independent of the layout builder and of the kernels: ``formula_block_mask``
evaluates the spec's formula element by element, ``crow_col_to_dense``
expands a user CSR, and the attention applies the exact token-level mask.
"""
import numpy as np


def formula_block_mask(n_heads, nb, local_blocks, vert_stride, homo_head=True, head_ids=None):
    """[len(head_ids), nb, nb] bool from the spec's formula (plain loops)."""
    head_ids = list(range(n_heads)) if head_ids is None else list(head_ids)
    step = 0 if homo_head else max(1, vert_stride // n_heads)
    out = np.zeros((len(head_ids), nb, nb), bool)
    for i, h in enumerate(head_ids):
        for qb in range(nb):
            for kb in range(qb + 1):
                out[i, qb, kb] = qb - kb < local_blocks or (kb + h * step + 1) % vert_stride == 0
    return out


def crow_col_to_dense(crow, col, nb=None):
    crow = np.asarray(crow)
    col = np.asarray(col)
    if crow.ndim == 1:
        crow, col = crow[None], col[None]
    nb = crow.shape[1] - 1 if nb is None else nb
    out = np.zeros((crow.shape[0], nb, nb), bool)
    for h in range(crow.shape[0]):
        for r in range(crow.shape[1] - 1):
            out[h, r, col[h, crow[h, r]:crow[h, r + 1]]] = True
    return out


def _prepare(q, k, v, cu_seqlens_k, cu_seqlens_q, block_mask, block_size, sm_scale, q_block_size):
    """float64 q, k, v; int64 cu_k, cu_q (cu_q derived when cu_seqlens_q is
    None); the softmax scale; and the block mask per query head [Hq, NB, NB],
    each row already the union of the rows of its q block."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    tq, hq, d = q.shape
    cu_k = np.asarray(cu_seqlens_k, np.int64)
    b = len(cu_k) - 1
    if cu_seqlens_q is None:
        cu_q = np.arange(b + 1) if tq == b else cu_k
    else:
        cu_q = np.asarray(cu_seqlens_q, np.int64)
    scale = 1.0 / np.sqrt(d) if sm_scale is None else float(sm_scale)
    bm = np.asarray(block_mask, bool)
    if bm.shape[0] == 1:
        bm = np.broadcast_to(bm, (hq,) + bm.shape[1:])
    nb = bm.shape[1]
    m = 1 if q_block_size is None else q_block_size // block_size
    if m > 1:  # union of the rows of each q block
        groups = -(-nb // m)
        pad = np.zeros((hq, groups * m, nb), bool)
        pad[:, :nb] = bm
        union = pad.reshape(hq, groups, m, nb).any(2)
        bm = np.repeat(union, m, axis=1)[:, :nb]
    return q, k, v, cu_k, cu_q, scale, bm


def blocksparse_attention_reference(q, k, v, cu_seqlens_k, cu_seqlens_q, block_mask, *,
                                    block_size, sm_scale=None, q_block_size=None):
    """float64 [Tq, Hq, D].

    ``block_mask`` [H or 1, NB, NB] bool: rows are absolute query blocks of
    ``block_size`` tokens. With q_block_size = m * block_size, a query attends
    to the union of the columns of the m rows of its q block. Queries are the
    last q_len positions of each sequence; keys at positions <= the query's.
    """
    q, k, v, cu_k, cu_q, scale, bm = _prepare(q, k, v, cu_seqlens_k, cu_seqlens_q, block_mask,
                                              block_size, sm_scale, q_block_size)
    tq, hq, d = q.shape
    hkv = k.shape[1]
    out = np.zeros((tq, hq, d))
    for i in range(len(cu_k) - 1):
        kl = cu_k[i + 1] - cu_k[i]
        ql = cu_q[i + 1] - cu_q[i]
        past = kl - ql
        qpos = past + np.arange(ql)
        kpos = np.arange(kl)
        for h in range(hq):
            allowed = bm[h][qpos[:, None] // block_size, kpos[None, :] // block_size]
            allowed &= kpos[None, :] <= qpos[:, None]
            qq = q[cu_q[i]:cu_q[i + 1], h]
            kk = k[cu_k[i]:cu_k[i + 1], h // (hq // hkv)]
            vv = v[cu_k[i]:cu_k[i + 1], h // (hq // hkv)]
            s = np.where(allowed, qq @ kk.T * scale, -np.inf)
            s -= s.max(1, keepdims=True)
            p = np.exp(s)
            out[cu_q[i]:cu_q[i + 1], h] = (p / p.sum(1, keepdims=True)) @ vv
    return out


def blocksparse_attention_backward_reference(q, k, v, cu_seqlens_k, cu_seqlens_q, block_mask,
                                             grad_output, *, block_size, sm_scale=None,
                                             q_block_size=None):
    """float64 gradients (dq [Tq, Hq, D], dk [Tk, Hkv, D], dv [Tk, Hkv, D]) of
    ``sum(grad_output * blocksparse_attention_reference(...))``, written from
    the math: per sequence and head, with S = scale * Q K^T (allowed entries),
    P = softmax(S), O = P V:
        dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(dO * O)),
        dQ = scale * dS K,  dK = scale * dS^T Q;
    GQA: a KV head's dk / dv sum over the query heads that read it. Tokens
    outside every sequence get zero gradients. Arguments as
    :func:`blocksparse_attention_reference`."""
    q, k, v, cu_k, cu_q, scale, bm = _prepare(q, k, v, cu_seqlens_k, cu_seqlens_q, block_mask,
                                              block_size, sm_scale, q_block_size)
    go = np.asarray(grad_output, np.float64)
    hq, hkv = q.shape[1], k.shape[1]
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for i in range(len(cu_k) - 1):
        kl = cu_k[i + 1] - cu_k[i]
        ql = cu_q[i + 1] - cu_q[i]
        qpos = kl - ql + np.arange(ql)
        kpos = np.arange(kl)
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        for h in range(hq):
            g = h // (hq // hkv)
            allowed = bm[h][qpos[:, None] // block_size, kpos[None, :] // block_size]
            allowed &= kpos[None, :] <= qpos[:, None]
            s = np.where(allowed, q[qs, h] @ k[ks, g].T * scale, -np.inf)
            s -= s.max(1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(1, keepdims=True)
            o = p @ v[ks, g]
            dv[ks, g] += p.T @ go[qs, h]
            dp = go[qs, h] @ v[ks, g].T
            ds = p * (dp - (go[qs, h] * o).sum(1, keepdims=True))
            dq[qs, h] = scale * ds @ k[ks, g]
            dk[ks, g] += scale * ds.T @ q[qs, h]
    return dq, dk, dv
