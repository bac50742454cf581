"""benchmarks/recycling_replay.py walks recorded answers as the engine drafts them (a synthetic recording): the
prompt's seed, a tree read from the recycled table, and n-gram lookup."""

from hf_specdec.tree.template import TreeTemplate


def _recording() -> list[dict]:
    """One answer cycling 1 2 3 4 after a prompt that shows the cycle; the target's best candidate after each
    position is the token that follows it, its other seven are 5 to 11."""
    tokens = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1]
    top = [[tokens[i + 1] if i + 1 < len(tokens) else 1, *range(5, 12)] for i in range(len(tokens))]
    return [{"category": "qa", "prompt_length": 5, "tokens": tokens, "top": top}]


def test_the_prompt_seeds_the_table_and_a_chain_reads_it(benchmark_script):
    replay = benchmark_script("recycling_replay")
    chain = TreeTemplate.chain(3)
    # seeded: every step drafts 3 tokens that the answer keeps, plus one; the 8 answer tokens take 2 forwards
    seeded, categories, _ = replay.replay_one(_recording(), chain, 0, cold=True)
    assert seeded == 4.0 and categories == {"qa": 4.0}
    # not seeded: the first steps draft from an empty table and learn one token's row each
    unseeded = replay.replay_one(_recording(), chain, 0, cold=True, prompt_seed=False)[0]
    assert 1.0 < unseeded < seeded
    # n-gram lookup finds the cycle in the prompt too
    assert replay.replay_one(_recording(), None, 3, cold=True)[0] == 4.0
