"""The tree-verify attention mask: reference vs brute force, kernel vs reference, ancestor bitmasks.

The Triton kernel runs on CPU under the Triton interpreter, which must be switched on (TRITON_INTERPRET=1) before
the kernel is decorated. So the kernel runs in one subprocess that gets the inputs of every case from a file and
writes back its outputs; the rest of the suite never sees the interpreter.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from hf_specdec.kernels import tree_mask
from hf_specdec.kernels.tree_mask import (
    ancestor_bits_from_parents,
    pack_bits,
    tree_attention_mask,
    tree_attention_mask_reference,
    unpack_bits,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None


def random_parents(batch: int, num_nodes: int, generator: torch.Generator, chain_bias: float = 0.0) -> torch.Tensor:
    """[B, W] random trees: node i hangs under node i - 1 with probability chain_bias, else under a random node < i."""
    parents = torch.full((batch, num_nodes), -1, dtype=torch.long)
    for node in range(1, num_nodes):
        random_parent = torch.randint(0, node, (batch,), generator=generator)
        extend_chain = torch.rand(batch, generator=generator) < chain_bias
        parents[:, node] = torch.where(extend_chain, node - 1, random_parent)
    return parents


def depths(parents: torch.Tensor) -> torch.Tensor:
    """[B, W] depth of each node (the root has depth 0)."""
    depth = torch.zeros_like(parents)
    for node in range(1, parents.shape[1]):
        depth[:, node] = depth.gather(1, parents[:, node : node + 1])[:, 0] + 1
    return depth


def make_inputs(
    batch: int, num_nodes: int, num_slots: int, seed: int, chain_bias: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ragged cache with left padding and holes, and a random tree per row.

    Returns valid [B, S], positions [B, S], query_positions [B, W], ancestor_bits [B, W, words], parents [B, W].
    """
    generator = torch.Generator().manual_seed(seed)
    slot = torch.arange(num_slots)
    padding = torch.randint(0, max(num_slots // 3, 1), (batch, 1), generator=generator)
    holes = torch.rand(batch, num_slots, generator=generator) < 0.15
    valid = (slot >= padding) & ~holes
    # Valid slots count positions from 0; padding and holes keep junk positions, which the mask must ignore.
    junk = torch.randint(-5, num_slots + num_nodes + 5, (batch, num_slots), generator=generator)
    positions = torch.where(valid, valid.long().cumsum(dim=1) - 1, junk)
    parents = random_parents(batch, num_nodes, generator, chain_bias)
    root_position = valid.long().sum(dim=1, keepdim=True)  # the last committed token follows the cached ones
    query_positions = root_position + depths(parents)
    return valid, positions, query_positions, ancestor_bits_from_parents(parents), parents


def brute_force_mask(valid, positions, query_positions, parents, window, dtype) -> torch.Tensor:
    """The mask rule by rule, one entry at a time, with ancestry from walking the parents."""
    batch, num_slots = valid.shape
    num_nodes = parents.shape[1]
    mask = torch.full((batch, 1, num_nodes, num_slots + num_nodes), torch.finfo(dtype).min, dtype=dtype)
    for b in range(batch):
        for q in range(num_nodes):
            query = int(query_positions[b, q])

            def in_window(position: int) -> bool:
                return window is None or position > query - window

            for s in range(num_slots):
                position = int(positions[b, s])
                if valid[b, s] and position <= query and in_window(position):
                    mask[b, 0, q, s] = 0.0
            node = q
            while node >= 0:
                if node == q or in_window(int(query_positions[b, node])):
                    mask[b, 0, q, num_slots + node] = 0.0
                node = int(parents[b, node])
    return mask


# ---------------------------------------------------------------------------------------------------------------
# Ancestor bitmasks
# ---------------------------------------------------------------------------------------------------------------


def signed(word: int) -> int:
    """An unsigned 64-bit pattern as the int64 that holds it."""
    return word - (1 << 64) if word >= 1 << 63 else word


@pytest.mark.parametrize(
    ("parents", "expected"),
    [
        pytest.param([-1, 0, 1, 2, 3], [0b1, 0b11, 0b111, 0b1111, 0b11111], id="chain"),
        pytest.param([-1, 0, 0, 0], [0b1, 0b11, 0b101, 0b1001], id="star"),
        # root -> {1, 2}; 1 -> {3, 4}; 2 -> {5}; 3 -> {6}: a Medusa-style tree with top-2 then top-1 choices
        pytest.param(
            [-1, 0, 0, 1, 1, 2, 3],
            [0b1, 0b11, 0b101, 0b1011, 0b10011, 0b100101, 0b1001011],
            id="medusa",
        ),
    ],
)
def test_ancestor_bits_of_literal_trees(parents, expected):
    bits = ancestor_bits_from_parents(torch.tensor([parents]))
    assert bits.dtype == torch.long
    assert bits[0, :, 0].tolist() == expected


def test_ancestor_bits_batch_of_different_trees_with_padding_nodes():
    # Row 1 is a 3-node chain padded to 5 nodes with padding nodes hanging under the root.
    bits = ancestor_bits_from_parents(torch.tensor([[-1, 0, 0, 1, 1], [-1, 0, 1, 0, 0]]))
    assert bits[..., 0].tolist() == [[0b1, 0b11, 0b101, 0b1011, 0b10011], [0b1, 0b11, 0b111, 0b1001, 0b10001]]


def test_ancestor_bits_of_a_70_node_chain_cross_the_word_boundary():
    num_nodes = 70
    bits = ancestor_bits_from_parents(torch.arange(-1, num_nodes - 1)[None])
    assert bits.shape == (1, num_nodes, 2)
    for node in range(num_nodes):
        ancestors = (1 << (node + 1)) - 1  # nodes 0..node, as one 70-bit integer
        low, high = ancestors & ((1 << 64) - 1), ancestors >> 64
        assert bits[0, node].tolist() == [signed(low), signed(high)], node
    assert bits[0, 63, 0] == -1  # bit 63 is the sign bit


def test_pack_and_unpack_bits_round_trip():
    flags = torch.rand(4, 5, 130, generator=torch.Generator().manual_seed(0)) < 0.5
    flags[..., 63] = True
    words = pack_bits(flags)
    assert words.shape == (4, 5, 3)
    assert torch.equal(unpack_bits(words, 130), flags)


# ---------------------------------------------------------------------------------------------------------------
# Reference vs brute force
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 1, 3, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_brute_force(window, dtype):
    valid, positions, query_positions, ancestor_bits, parents = make_inputs(3, 9, 14, seed=1, chain_bias=0.5)
    expected = brute_force_mask(valid, positions, query_positions, parents, window, dtype)
    mask = tree_attention_mask_reference(valid, positions, query_positions, ancestor_bits, window, dtype)
    assert mask.shape == (3, 1, 9, 14 + 9) and mask.dtype == dtype
    torch.testing.assert_close(mask, expected, rtol=0, atol=0)


def test_reference_without_cache_is_the_tree_itself():
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3]])
    query_positions = 10 + depths(parents)
    empty = torch.zeros(1, 0, dtype=torch.bool)
    mask = tree_attention_mask_reference(empty, empty.long(), query_positions, ancestor_bits_from_parents(parents),
                                         None, torch.float32)
    assert torch.equal(mask[0, 0] == 0, unpack_bits(ancestor_bits_from_parents(parents), 7)[0])


# ---------------------------------------------------------------------------------------------------------------
# Kernel (Triton interpreter, in a subprocess) vs reference
# ---------------------------------------------------------------------------------------------------------------

# name: (batch, num_nodes, num_slots, window, dtype, chain_bias)
KERNEL_CASES = {
    "odd-fp32": (3, 37, 1001, None, torch.float32, 0.0),
    "odd-fp16": (3, 37, 1001, None, torch.float16, 0.0),
    "odd-bf16": (3, 37, 1001, None, torch.bfloat16, 0.0),
    "odd-fp32-window4": (3, 37, 1001, 4, torch.float32, 0.5),
    "odd-fp16-window300": (3, 37, 1001, 300, torch.float16, 0.0),
    "odd-bf16-window1": (3, 37, 1001, 1, torch.bfloat16, 0.0),
    "one-node": (3, 1, 1001, None, torch.float16, 0.0),
    "one-node-window": (3, 1, 1001, 5, torch.bfloat16, 0.0),
    "64-nodes": (2, 64, 50, None, torch.float16, 0.9),
    "65-nodes-window": (2, 65, 50, 60, torch.float32, 0.9),
    "no-cache": (2, 37, 0, None, torch.float16, 0.3),
    "no-cache-window": (2, 37, 0, 3, torch.bfloat16, 0.3),
}

# Loads tree_mask.py by path: the subprocess skips importing the package (and transformers) around it.
_KERNEL_WORKER = """
import importlib.util, sys
import torch
spec = importlib.util.spec_from_file_location("tree_mask", sys.argv[1])
tree_mask = sys.modules["tree_mask"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tree_mask)
cases = torch.load(sys.argv[2])
outputs = {name: tree_mask.tree_attention_mask(*args, use_kernel=True) for name, args in cases.items()}
torch.save(outputs, sys.argv[3])
"""


def kernel_case_arguments(name: str) -> tuple:
    batch, num_nodes, num_slots, window, dtype, chain_bias = KERNEL_CASES[name]
    seed = list(KERNEL_CASES).index(name)
    valid, positions, query_positions, ancestor_bits, _ = make_inputs(batch, num_nodes, num_slots, seed, chain_bias)
    return valid, positions, query_positions, ancestor_bits, window, dtype


@pytest.fixture(scope="module")
def interpreted_kernel_outputs(tmp_path_factory) -> dict[str, torch.Tensor]:
    """Every case of KERNEL_CASES through the Triton kernel, in one interpreter subprocess."""
    if not HAS_TRITON:
        pytest.skip(f"triton is not installed ({tree_mask.INSTALL_TRITON})")
    folder = tmp_path_factory.mktemp("tree_mask")
    cases, outputs = folder / "cases.pt", folder / "outputs.pt"
    torch.save({name: kernel_case_arguments(name) for name in KERNEL_CASES}, cases)
    command = [sys.executable, "-c", _KERNEL_WORKER, tree_mask.__file__, str(cases), str(outputs)]
    result = subprocess.run(command, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return torch.load(outputs)


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_kernel_matches_reference(name, interpreted_kernel_outputs):
    arguments = kernel_case_arguments(name)
    expected = tree_attention_mask_reference(*arguments)
    mask = interpreted_kernel_outputs[name]
    assert mask.shape == expected.shape and mask.dtype == expected.dtype
    torch.testing.assert_close(mask, expected, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and a CUDA device")
@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_kernel_matches_reference_on_cuda(name):
    arguments = [a.cuda() if isinstance(a, torch.Tensor) else a for a in kernel_case_arguments(name)]
    mask = tree_attention_mask(*arguments)  # auto: the kernel, for CUDA tensors
    torch.testing.assert_close(mask, tree_attention_mask_reference(*arguments), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# Choosing the path
# ---------------------------------------------------------------------------------------------------------------


def test_auto_on_cpu_without_the_interpreter_uses_the_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    arguments = kernel_case_arguments("64-nodes")
    torch.testing.assert_close(tree_attention_mask(*arguments), tree_attention_mask_reference(*arguments),
                               rtol=0, atol=0)


@pytest.mark.skipif(not HAS_TRITON, reason=f"triton is not installed ({tree_mask.INSTALL_TRITON})")
def test_forcing_the_kernel_on_cpu_without_the_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="CUDA tensors, or TRITON_INTERPRET=1"):
        tree_attention_mask(*kernel_case_arguments("one-node"), use_kernel=True)


# Blocks triton, then imports the package, builds masks and decodes with a token tree: everything must work on the
# torch reference, even with TRITON_INTERPRET=1 asking for the kernel.
_WITHOUT_TRITON_WORKER = """
import sys
sys.modules["triton"] = None  # `import triton` now raises ImportError
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import hf_specdec
from hf_specdec.kernels import tree_mask

assert tree_mask.triton is None
parents = torch.tensor([[-1, 0, 0, 1]])
query_positions = torch.tensor([[3, 4, 4, 5]])
bits = tree_mask.ancestor_bits_from_parents(parents)
arguments = (torch.ones(1, 3, dtype=torch.bool), torch.arange(3)[None], query_positions, bits, None, torch.float16)
expected = [[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 1, 0, 1]]
for use_kernel in (None, False):
    mask = tree_mask.tree_attention_mask(*arguments, use_kernel=use_kernel)
    assert (mask[0, 0] == 0).long().tolist() == expected, (use_kernel, mask)
mask = tree_mask.ancestry_attention_mask(*arguments[:3], tree_mask.unpack_bits(bits, 4), None, torch.float16,
                                         query_positions)
assert (mask[0, 0] == 0).long().tolist() == expected, mask
try:
    tree_mask.tree_attention_mask(*arguments, use_kernel=True)
except RuntimeError as error:
    assert 'hf-specdec[triton]' in str(error), error
else:
    raise AssertionError("use_kernel=True without triton did not raise")

torch.manual_seed(0)
config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, pad_token_id=0, eos_token_id=None)
model = LlamaForCausalLM(config).eval()
ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6, 8, 5, 6]])
kwargs = dict(max_new_tokens=12, do_sample=False)
tree = hf_specdec.SpeculativeConfig(method="ngram", num_speculative_tokens=3, tree_width=2, prompt_lookup_min=1)
assert torch.equal(hf_specdec.generate(model, ids, speculative=tree, **kwargs), model.generate(ids, **kwargs))
"""


def test_package_works_without_triton():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", _WITHOUT_TRITON_WORKER], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
