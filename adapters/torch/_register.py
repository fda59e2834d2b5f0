"""torch.library registration shared by every op.

Each public op is a ``torch.library`` custom op (so torch.compile sees one opaque
node with declared mutations), but eager calls skip the dispatcher and run the
implementation directly: the custom-op dispatch costs more host time than the
kernel launch itself for decode-sized inputs.
"""
from __future__ import annotations

import torch

NAMESPACE = "tandem_attn"


def custom_op(name: str, impl, mutates_args=(), fake=None):
    """Register ``impl`` as ``torch.ops.tandem_attn.<name>`` and return a callable
    that dispatches through the op while compiling and calls ``impl`` eagerly.

    Ops that only mutate their arguments need no fake implementation beyond
    returning None; ops that return tensors pass ``fake``.
    """
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=mutates_args)(impl)
    op.register_fake(fake if fake is not None else (lambda *args, **kwargs: None))
    is_compiling = torch.compiler.is_compiling

    def call(*args):
        if is_compiling():
            return op(*args)
        return impl(*args)

    call.op = op
    return call
