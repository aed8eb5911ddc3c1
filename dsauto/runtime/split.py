"""Operator splitting (OSDP, Jiang et al. 2023, Sec. 4.2): a large operator computed as k slices.

Under ZeRO-3 a module's parameters are gathered whole when the module runs
(deepspeed/runtime/zero/parameter_offload.py registers a pre-forward hook on every module that
fetches that module's own parameters, ``PartitionedParameterCoordinator.fetch_sub_module``). A
matrix cut into k slices, each its own ``Parameter`` in its own submodule, is therefore gathered one
slice at a time, and the transient peak of the gathered weights falls from the whole matrix to a
slice: the cost model's ``2 x largest_op_params / split`` (the slice in use and the prefetched next
one, dsauto/cost/layer.py).

What is split, per flat layer of the plan:

- a transformer block (layers 1..L): every ``nn.Linear`` of the block whose weight is larger than
  the block's largest weight divided by k becomes a :class:`SplitLinear` of k input-feature slices,
  ``y = sum_i x[..., cols_i] @ W_i^T + b``. The largest matrices (fused QKV, MLP in/out) are always
  split, and after splitting no single gathered matrix exceeds ``largest / k`` elements, the unit
  the cost model assumes;
- the embedding (layer 0): the token table becomes k column slices (:class:`SplitEmbedding`); an LM
  head tied to it becomes a :class:`SplitLinear` over the same slice parameters, so the tie holds;
- the head (layer L+1): the LM head and cross-entropy run over k token chunks, each under
  non-reentrant activation checkpointing, so one chunk's logits exist at a time (its logits and
  softmax are freed when its loss is computed and recomputed in backward): the cost model's
  ``logits / split``. The LM head weight itself is not cut.

Splitting re-parameterises the model: parameter names change (``mlp_in.weight`` becomes
``mlp_in.slices.0.weight`` ...), so checkpoints saved with a split plan load under the same plan.
The functions return which old parameter became which new ones, so that the caller can re-point an
optimizer built before the split.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dsauto.errors import DsautoError

Replacements = dict[nn.Parameter, tuple[nn.Parameter, ...]]
"""Old parameter -> the parameters that replace it, in slice order."""

IGNORE_INDEX = -100
"""Label that does not count in the loss (torch.nn.functional.cross_entropy's default)."""


def _slice_sizes(width: int, slices: int, what: str) -> list[int]:
    if slices > width:
        raise DsautoError(f"Cannot split {what} of width {width} into {slices} slices; lower the "
                          f"split factor to at most {width}.")
    return [len(part) for part in torch.arange(width).tensor_split(slices)]


def _refuse_zero_params(*params: nn.Parameter) -> None:
    # Parameters created under deepspeed.zero.Init are already partitioned (partition_parameters.py
    # gives each a ds_id and an empty .data); their values cannot be sliced here.
    if any(hasattr(p, "ds_id") for p in params):
        raise DsautoError("The model was built under deepspeed.zero.Init, so its parameters are already "
                          "partitioned and cannot be split; build it outside zero.Init when the plan "
                          "splits operators.")


class SplitLinear(nn.Module):
    """A linear layer as k input-feature slices, each its own submodule: ``y = sum_i x_i W_i^T + b``."""

    def __init__(self, slices: list[nn.Linear], bias: nn.Parameter | None):
        super().__init__()
        self.slices = nn.ModuleList(slices)
        self.bias = bias
        self.in_features = sum(s.in_features for s in slices)
        self.out_features = slices[0].out_features

    @classmethod
    def from_linear(cls, linear: nn.Linear, slices: int) -> SplitLinear:
        """The same function as ``linear``, its weight copied into ``slices`` column blocks."""
        _refuse_zero_params(*linear.parameters())
        sizes = _slice_sizes(linear.in_features, slices, f"a Linear({linear.in_features}, {linear.out_features})")
        parts = []
        with torch.no_grad():
            for weight in linear.weight.split(sizes, dim=1):
                part = nn.Linear(weight.shape[1], linear.out_features, bias=False,
                                 device=weight.device, dtype=weight.dtype)
                part.weight.copy_(weight)
                part.weight.requires_grad_(linear.weight.requires_grad)
                parts.append(part)
        return cls(parts, linear.bias)

    @classmethod
    def over(cls, weights: list[nn.Parameter], bias: nn.Parameter | None) -> SplitLinear:
        """A split linear layer whose slices use the given weight parameters (shared, not copied)."""
        parts = []
        for weight in weights:
            part = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            part.weight = weight
            parts.append(part)
        return cls(parts, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, start = None, 0
        for part in self.slices:
            y = part(x[..., start:start + part.in_features])
            start += part.in_features
            # Out of place: the sum is a new tensor, never an output DeepSpeed's hooks wrapped.
            out = y if out is None else out + y
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, slices={len(self.slices)}"


class SplitEmbedding(nn.Module):
    """An embedding table as k column slices, each its own submodule; the lookups are concatenated."""

    def __init__(self, embedding: nn.Embedding, slices: int):
        super().__init__()
        _refuse_zero_params(embedding.weight)
        if embedding.max_norm is not None or embedding.sparse:
            raise DsautoError("Cannot split an nn.Embedding with max_norm or sparse gradients; set the "
                              "embedding's split to 1.")
        sizes = _slice_sizes(embedding.embedding_dim, slices, f"an Embedding of dimension {embedding.embedding_dim}")
        parts = []
        with torch.no_grad():
            for weight in embedding.weight.split(sizes, dim=1):
                part = nn.Embedding(embedding.num_embeddings, weight.shape[1], padding_idx=embedding.padding_idx,
                                    scale_grad_by_freq=embedding.scale_grad_by_freq,
                                    device=weight.device, dtype=weight.dtype)
                part.weight.copy_(weight)
                part.weight.requires_grad_(embedding.weight.requires_grad)
                parts.append(part)
        self.slices = nn.ModuleList(parts)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(tokens) for part in self.slices], dim=-1)


def _replace_child(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


def split_block(block: nn.Module, slices: int) -> Replacements:
    """Splits the large ``nn.Linear``s of a transformer block into ``slices`` input-feature slices.

    Every Linear whose weight has more than ``largest / slices`` elements is split, so that no
    gathered matrix is larger than the cost model's unit ``largest_op_params / split``.
    """
    linears = [(name, m) for name, m in block.named_modules() if type(m) is nn.Linear]
    if not linears:
        raise DsautoError(f"The plan splits {type(block).__name__} into {slices} slices, but the block has "
                          f"no nn.Linear to split; set its split to 1.")
    largest = max(m.weight.numel() for _, m in linears)
    replaced: Replacements = {}
    for name, linear in linears:
        if linear.weight.numel() * slices > largest:
            split = SplitLinear.from_linear(linear, slices)
            _replace_child(block, name, split)
            replaced[linear.weight] = tuple(part.weight for part in split.slices)
    return replaced


def split_embedding(model: nn.Module, embedding: nn.Module, slices: int) -> Replacements:
    """Splits the largest ``nn.Embedding`` inside ``embedding`` into ``slices`` column slices; an
    ``nn.Linear`` anywhere in ``model`` that shares its weight (a tied LM head) shares the slices."""
    tables = [(name, m) for name, m in embedding.named_modules() if type(m) is nn.Embedding]
    if not tables:
        raise DsautoError(f"The plan splits the embedding into {slices} slices, but "
                          f"{type(embedding).__name__} has no nn.Embedding; set layer 0's split to 1.")
    name, table = max(tables, key=lambda t: t[1].weight.numel())
    split = SplitEmbedding(table, slices)
    new_weights = [part.weight for part in split.slices]
    tied = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear and m.weight is table.weight]
    _replace_child(embedding, name, split)
    for linear_name, linear in tied:
        # The tied head's weight (vocab, hidden) split along hidden is the embedding's column
        # slices: logits = sum_i h[:, cols_i] @ E_i^T, so both modules train the same parameters.
        _replace_child(model, linear_name, SplitLinear.over(new_weights, linear.bias))
    return {table.weight: tuple(new_weights)}


def chunked_cross_entropy(lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                          chunks: int) -> torch.Tensor:
    """Mean cross-entropy of ``lm_head(hidden)`` against ``labels``, computed over ``chunks`` token
    chunks so that only one chunk's logits exist at a time.

    Each chunk runs under non-reentrant checkpointing (torch.utils.checkpoint), which keeps only the
    chunk's input and recomputes its logits in backward, so the full logits never exist, in forward
    or in backward. The sum of per-chunk losses over the count of counted labels equals
    ``F.cross_entropy(logits.float(), labels)`` up to summation order.
    """
    hidden, labels = hidden.flatten(0, -2), labels.flatten()

    def chunk_loss(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(lm_head(h).float(), y, ignore_index=IGNORE_INDEX, reduction="sum")

    total = None
    for h, y in zip(hidden.tensor_split(chunks), labels.tensor_split(chunks), strict=True):
        loss = checkpoint(chunk_loss, h, y, use_reentrant=False)
        total = loss if total is None else total + loss
    counted = (labels != IGNORE_INDEX).sum()
    return total / counted.to(total.dtype)


def chunk_head_loss(head: nn.Module, chunks: int) -> None:
    """Makes ``head(x, labels)`` compute its LM head and loss in ``chunks`` token chunks.

    The head must be shaped like :class:`dsauto.models.gpt.Head`: ``hidden(x)`` gives the LM-head
    input, ``lm_head`` is the vocabulary projection, and ``forward(x, labels)`` returns the mean
    cross-entropy. The LM head module itself is called per chunk, so ZeRO-3's hooks gather its
    weight as they would for one call.
    """
    require_chunkable(head, chunks)

    def forward(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return chunked_cross_entropy(head.lm_head, head.hidden(x), labels, chunks)

    _replace_forward(head, forward)


def require_chunkable(head: nn.Module | None, chunks: int) -> None:
    """Refuses a head that :func:`chunk_head_loss` cannot chunk (checked before anything is changed)."""
    if head is None:
        raise DsautoError(f"The plan computes the LM head in {chunks} chunks, but the model has no 'head' "
                          f"module; name the head module 'head' or set the head's split to 1.")
    if not callable(getattr(head, "hidden", None)) or not isinstance(getattr(head, "lm_head", None), nn.Module):
        raise DsautoError(f"The plan computes the LM head in {chunks} chunks, but {type(head).__name__} has no "
                          f"hidden(x) method and lm_head module to chunk; shape the head like "
                          f"dsauto.models.gpt.Head or set the head's split to 1.")


def _replace_forward(module: nn.Module, forward: Callable[..., torch.Tensor]) -> None:
    # An instance attribute shadows the class's forward; nn.Module.__call__ (and so every hook
    # DeepSpeed registers on the module) still runs around it, and parameter names do not change.
    module.forward = forward
