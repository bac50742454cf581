"""benchmarks/suffix_draft_classes.py: its match-length buckets are the schedule's draft classes, and its tables
count what they are given (the real run needs the real model)."""


from hf_specdec.proposers.suffix import MATCH_CLASS_BOUNDS, match_class
from hf_specdec.suffix.draft import SuffixDraft


def test_match_buckets_are_the_draft_classes(benchmark_script):
    module = benchmark_script("suffix_draft_classes")
    by_bucket: dict[str, set[int]] = {}
    for length in range(1, 3 * MATCH_CLASS_BOUNDS[-1]):
        draft = SuffixDraft((7,), (-1,), (1,), (1.0,), 1.0, length, source="local")
        by_bucket.setdefault(module.match_bucket(length), set()).add(match_class(draft))
    assert all(len(classes) == 1 for classes in by_bucket.values())
    assert len(by_bucket) == len(MATCH_CLASS_BOUNDS)
    assert module.match_bucket(1) == "1" and module.match_bucket(5) == "4-5"
    assert module.match_bucket(100) == f"{MATCH_CLASS_BOUNDS[-1]}+"


def test_tables_count_first_tokens_accepted(benchmark_script):
    module = benchmark_script("suffix_draft_classes")
    records = [{"match": 1, "source": "local", "first_prob": 0.9, "accepted": 0},
               {"match": 1, "source": "global", "first_prob": 0.2, "accepted": 2},
               {"match": 10, "source": "local", "first_prob": 1.0, "accepted": 5}]
    table = module.summarize(records, lambda r: module.match_bucket(r["match"]))
    assert table["1"] == {"row_steps": 2, "first_accepted": 0.5, "mean_accepted": 1.0}
    assert table["9-13"]["first_accepted"] == 1.0
    assert module.probability_bucket(1.0) == "0.75-1.00" and module.probability_bucket(0.2) == "0.00-0.25"
    labels = ["local, 9-13", "global, 1", "local, 1"]
    assert sorted(labels, key=module.label_order) == ["global, 1", "local, 1", "local, 9-13"]
