"""The additive attention mask of a tree-verify forward over the ragged KV cache, in torch and as a Triton kernel.

The batch shares a slot axis of S cached slots (`hf_specdec.cache.ragged`): `valid [B, S]` says which slots a row
may attend to and `positions [B, S]` holds each slot's position id. A verify step appends W slots per row that
hold a token tree; node 0 is the root (the row's last committed token) and a node's position is the root's
position plus its depth. The mask of that forward has shape [B, 1, W, S + W], holds 0.0 where attention is
allowed and `torch.finfo(dtype).min` elsewhere, and lets query node q of row b attend to
- cached slot s < S iff `valid[b, s]` and `positions[b, s] <= query_positions[b, q]`
  (and, with a sliding window, `positions[b, s] > query_positions[b, q] - window`);
- new slot S + j iff node j is an ancestor of q or q itself
  (and, with a window, `query_positions[b, j] > query_positions[b, q] - window`);
- its own slot S + q always, so no row of the mask is fully masked.

Tree ancestry travels as a bitmask, `ancestor_bits [B, W, ceil(W / 64)]` (int64): bit j % 64 of word j // 64 of
row (b, q) is set iff node j is an ancestor-or-self of node q. Bit 63 is the sign bit of the int64 word.

The file reads as the Triton tutorials do: the torch reference, the kernel, its launcher, then the public
`tree_attention_mask`, which picks the kernel for CUDA tensors (or under `TRITON_INTERPRET=1`) and the reference
otherwise.

triton is optional (`pip install "hf-specdec[triton]"`; torch's CUDA wheels already bring it): without it this
module imports, the kernel is never chosen, and every mask comes from the torch reference.
"""

from __future__ import annotations

import os

import torch

try:  # optional: everything but the kernel path works without triton
    import triton
    import triton.language as tl
except ImportError:
    triton = None

INSTALL_TRITON = 'pip install "hf-specdec[triton]"'
BITS_PER_WORD = 64
# The value of bit j of an int64 word; bit 63 is the sign bit.
BIT_VALUES = [1 << j for j in range(BITS_PER_WORD - 1)] + [-(1 << (BITS_PER_WORD - 1))]


def num_ancestor_words(num_nodes: int) -> int:
    """int64 words per node in an ancestor bitmask of `num_nodes` nodes."""
    return (num_nodes + BITS_PER_WORD - 1) // BITS_PER_WORD


def ancestor_bits_from_parents(
    # [B, W] long: parents[b, 0] = -1 (the root), parents[b, i] < i
    parents: torch.Tensor,
) -> torch.Tensor:
    """Ancestor-or-self bitmasks [B, W, ceil(W / 64)] (int64) of the trees given by their parent indices."""
    batch, num_nodes = parents.shape
    device = parents.device
    rows = torch.arange(batch, device=device)
    # Parents come before their children, so node i's ancestor row is its parent's row plus i itself.
    is_ancestor = torch.eye(num_nodes, dtype=torch.bool, device=device).repeat(batch, 1, 1)  # [B, W, W]
    for node in range(1, num_nodes):
        parent = parents[:, node].clamp(min=0)  # [B]; a padding node marked -1 hangs under the root
        is_ancestor[:, node] |= is_ancestor[rows, parent]
    return pack_bits(is_ancestor)


def pack_bits(
    # [..., N] bool
    flags: torch.Tensor,
) -> torch.Tensor:
    """Pack the last axis into int64 words [..., ceil(N / 64)]: flag j becomes bit j % 64 of word j // 64."""
    num_flags = flags.shape[-1]
    padded = torch.nn.functional.pad(flags, (0, num_ancestor_words(num_flags) * BITS_PER_WORD - num_flags))
    words = padded.unflatten(-1, (-1, BITS_PER_WORD)).long()  # [..., words, 64]
    bit_values = torch.tensor(BIT_VALUES, dtype=torch.long, device=flags.device)
    return (words * bit_values).sum(dim=-1)  # the bits are disjoint, so the sum is a bitwise or (and never overflows)


def unpack_bits(
    # [..., words] int64
    words: torch.Tensor,
    num_flags: int,
) -> torch.Tensor:
    """The inverse of `pack_bits`: bool [..., num_flags]."""
    flag = torch.arange(num_flags, device=words.device)
    # >> is arithmetic on int64, so the sign bit (63) shifts down to -1, whose lowest bit is set: & 1 reads it.
    return ((words[..., flag // BITS_PER_WORD] >> (flag % BITS_PER_WORD)) & 1).bool()


# ---------------------------------------------------------------------------------------------------------------
# 1. Reference
# ---------------------------------------------------------------------------------------------------------------


def tree_attention_mask_from_ancestors(
    # [B, S] bool
    valid: torch.Tensor,
    # [B, S] long
    positions: torch.Tensor,
    # [B, W] long
    query_positions: torch.Tensor,
    # [B, W, R] bool: entry (q, j) is True iff region slot j is an ancestor of query q (the last W region slots
    # are the queries themselves; R = W unless the region spans earlier forwards)
    ancestors: torch.Tensor,
    window: int | None,
    dtype: torch.dtype,
    # [B, R] long: positions of the region slots; None means the region is the queries (R = W)
    region_positions: torch.Tensor | None = None,
    # region slot of the first query (the queries are region slots query_start .. query_start + W - 1); None: the
    # last W region slots
    query_start: int | None = None,
) -> torch.Tensor:
    """The additive mask [B, 1, W, S + R] in `dtype`, in plain torch, from unpacked ancestry.

    Memory traffic: reads B*S + B*S + B*W + B*W*R elements, materialises a few bool [B, W, S + R] tensors,
    writes B*W*(S + R) elements of `dtype`.
    """
    num_nodes = query_positions.shape[1]
    query = query_positions[:, :, None]  # [B, W, 1]
    cached_positions = positions[:, None, :]  # [B, 1, S]
    key_positions = (query_positions if region_positions is None else region_positions)[:, None, :]  # [B, 1, R]

    cached = valid[:, None, :] & (cached_positions <= query)  # [B, W, S]
    tree = ancestors.clone()
    if window is not None:
        cached &= cached_positions > query - window
        tree &= key_positions > query - window
    start = tree.shape[2] - num_nodes if query_start is None else query_start
    tree[:, :, start : start + num_nodes] |= torch.eye(num_nodes, dtype=torch.bool, device=tree.device)  # itself

    allowed = torch.cat([cached, tree], dim=-1)  # [B, W, S + R]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def tree_attention_mask_reference(
    # [B, S] bool
    valid: torch.Tensor,
    # [B, S] long
    positions: torch.Tensor,
    # [B, W] long
    query_positions: torch.Tensor,
    # [B, W, ceil(W / 64)] int64
    ancestor_bits: torch.Tensor,
    window: int | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The kernel's ground truth, with the kernel's signature: unpack the bits, then the torch construction."""
    ancestors = unpack_bits(ancestor_bits, query_positions.shape[1])
    return tree_attention_mask_from_ancestors(valid, positions, query_positions, ancestors, window, dtype)


# ---------------------------------------------------------------------------------------------------------------
# 2. Kernel
# ---------------------------------------------------------------------------------------------------------------


def _jit(fn):
    """`triton.jit` when triton imports; without triton the plain function stays, and is never launched."""
    return fn if triton is None else triton.jit(fn)


@_jit
def _tree_mask_kernel(
    valid_ptr,  # [B, S] uint8
    positions_ptr,  # [B, S] int64
    query_positions_ptr,  # [B, W] int64
    ancestor_bits_ptr,  # [B, W, words] int64
    out_ptr,  # [B, 1, W, S + W]
    num_slots,  # S
    num_nodes,  # W
    window,  # ignored unless HAS_WINDOW
    masked_value,  # torch.finfo(out dtype).min, exact in fp32 for fp32, fp16 and bf16
    stride_valid_b,
    stride_valid_s,
    stride_positions_b,
    stride_positions_s,
    stride_query_b,
    stride_query_w,
    stride_bits_b,
    stride_bits_w,
    stride_bits_word,
    stride_out_b,
    stride_out_w,
    stride_out_col,
    HAS_WINDOW: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program per (row b, query node q) and block of BLOCK_N key columns of the S + W.
    # int64 offsets: B * W * (S + W) may pass 2**31.
    row = tl.program_id(0).to(tl.int64)
    b = row // num_nodes
    q = row % num_nodes
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    query_position = tl.load(query_positions_ptr + b * stride_query_b + q * stride_query_w)

    # Cached slots s = cols < S.
    is_cached = cols < num_slots
    slot_valid = tl.load(valid_ptr + b * stride_valid_b + cols * stride_valid_s, mask=is_cached, other=0)
    slot_position = tl.load(positions_ptr + b * stride_positions_b + cols * stride_positions_s, mask=is_cached,
                            other=0)
    allowed_cached = is_cached & (slot_valid != 0) & (slot_position <= query_position)
    if HAS_WINDOW:
        allowed_cached = allowed_cached & (slot_position > query_position - window)

    # New slots S + j: node j, allowed when it is an ancestor-or-self of q (bit j of q's bitmask).
    node = cols - num_slots
    is_node = (node >= 0) & (node < num_nodes)
    node = tl.where(is_node, node, 0)
    word = tl.load(ancestor_bits_ptr + b * stride_bits_b + q * stride_bits_w + (node // 64) * stride_bits_word,
                   mask=is_node, other=0)
    # >> on int64 is arithmetic: the sign bit (63) comes down as -1, whose lowest bit is set.
    is_ancestor = ((word >> (node % 64)) & 1) != 0
    allowed_tree = is_node & is_ancestor
    if HAS_WINDOW:
        node_position = tl.load(query_positions_ptr + b * stride_query_b + node * stride_query_w, mask=is_node,
                                other=0)
        allowed_tree = allowed_tree & (node_position > query_position - window)
    allowed_tree = allowed_tree | (is_node & (node == q))  # a query always sees itself

    allowed = allowed_cached | allowed_tree
    value = tl.where(allowed, 0.0, masked_value)
    num_cols = num_slots + num_nodes
    tl.store(out_ptr + b * stride_out_b + q * stride_out_w + cols * stride_out_col,
             value.to(out_ptr.dtype.element_ty), mask=cols < num_cols)


# ---------------------------------------------------------------------------------------------------------------
# 3. Launcher
# ---------------------------------------------------------------------------------------------------------------

# Columns per program: wide blocks keep the grid small (B * W rows of at most a few blocks each).
MAX_BLOCK_N = 1024


def tree_attention_mask_triton(
    # [B, S] bool
    valid: torch.Tensor,
    # [B, S] long
    positions: torch.Tensor,
    # [B, W] long
    query_positions: torch.Tensor,
    # [B, W, ceil(W / 64)] int64
    ancestor_bits: torch.Tensor,
    window: int | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The same mask as `tree_attention_mask_reference`, written by one Triton kernel launch."""
    if triton is None:
        raise RuntimeError(f"tree_attention_mask_triton needs triton, which is not installed ({INSTALL_TRITON}); "
                           "or call tree_attention_mask_reference")
    batch, num_slots = valid.shape
    num_nodes = query_positions.shape[1]
    if ancestor_bits.shape != (batch, num_nodes, num_ancestor_words(num_nodes)):
        raise ValueError(f"ancestor_bits has shape {tuple(ancestor_bits.shape)}, expected "
                         f"{(batch, num_nodes, num_ancestor_words(num_nodes))}")
    valid = valid.contiguous().view(torch.uint8)  # bool and uint8 share their byte layout
    positions = positions.contiguous().long()
    query_positions = query_positions.contiguous().long()
    ancestor_bits = ancestor_bits.contiguous()
    num_cols = num_slots + num_nodes
    out = torch.empty((batch, 1, num_nodes, num_cols), dtype=dtype, device=valid.device)
    if out.numel() == 0:
        return out

    block_n = min(MAX_BLOCK_N, triton.next_power_of_2(num_cols))
    grid = (batch * num_nodes, triton.cdiv(num_cols, block_n))
    _tree_mask_kernel[grid](
        valid, positions, query_positions, ancestor_bits, out,
        num_slots, num_nodes, 0 if window is None else window, torch.finfo(dtype).min,
        valid.stride(0), valid.stride(1),
        positions.stride(0), positions.stride(1),
        query_positions.stride(0), query_positions.stride(1),
        ancestor_bits.stride(0), ancestor_bits.stride(1), ancestor_bits.stride(2),
        out.stride(0), out.stride(2), out.stride(3),
        HAS_WINDOW=window is not None,
        BLOCK_N=block_n,
    )
    return out


# ---------------------------------------------------------------------------------------------------------------
# 4. Public entry point
# ---------------------------------------------------------------------------------------------------------------


def triton_interpreter_enabled() -> bool:
    """True when TRITON_INTERPRET=1: Triton kernels then run on CPU tensors, slowly (used by the tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def tree_attention_mask(
    # [B, S] bool
    valid: torch.Tensor,
    # [B, S] long
    positions: torch.Tensor,
    # [B, W] long
    query_positions: torch.Tensor,
    # [B, W, ceil(W / 64)] int64
    ancestor_bits: torch.Tensor,
    window: int | None,
    dtype: torch.dtype,
    use_kernel: bool | None = None,
) -> torch.Tensor:
    """The additive tree-verify mask [B, 1, W, S + W] (see the module docstring).

    `use_kernel=None` picks the Triton kernel when triton imports and the tensors are on CUDA (or the Triton
    interpreter is on), the torch reference otherwise; True forces the kernel, False the reference.
    """
    kernel_can_run = _kernel_can_run(valid)
    if use_kernel is None:
        use_kernel = triton is not None and kernel_can_run
    elif use_kernel:
        if triton is None:
            raise RuntimeError(f"use_kernel=True needs triton, which is not installed ({INSTALL_TRITON}); "
                               "or pass use_kernel=None to use the torch reference")
        if not kernel_can_run:
            raise RuntimeError("use_kernel=True needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is "
                               "imported to run the kernel on CPU")
    fn = tree_attention_mask_triton if use_kernel else tree_attention_mask_reference
    return fn(valid, positions, query_positions, ancestor_bits, window, dtype)


def _kernel_can_run(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda or triton_interpreter_enabled()


def ancestry_attention_mask(
    # [B, S] bool
    valid: torch.Tensor,
    # [B, S] long
    positions: torch.Tensor,
    # [B, W] long
    query_positions: torch.Tensor,
    # [B, W, R] bool
    ancestors: torch.Tensor,
    window: int | None,
    dtype: torch.dtype,
    # [B, R] long
    region_positions: torch.Tensor,
    # region slot of the first query; None: the last W region slots
    query_start: int | None = None,
) -> torch.Tensor:
    """What the engine calls. When the region is just the queries (every verify step) and the kernel can run,
    the kernel (bits packed for it); otherwise the torch construction straight from the bool ancestry (no
    packing round trip on the CPU; a region spanning several forwards, as a draft model drafting a tree depth by
    depth makes, is only handled here)."""
    if triton is not None and _kernel_can_run(valid) and ancestors.shape[2] == query_positions.shape[1]:
        return tree_attention_mask_triton(valid, positions, query_positions, pack_bits(ancestors), window, dtype)
    return tree_attention_mask_from_ancestors(valid, positions, query_positions, ancestors, window, dtype,
                                              region_positions, query_start)
