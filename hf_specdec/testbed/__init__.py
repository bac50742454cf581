"""A small trained code-model family (tokenizer, target, draft) and benchmark prompts.

The models are trained on the Python standard library by ``examples/train_testbed.py``
and committed under ``examples/testbed``.
"""

from hf_specdec.testbed.loading import load_testbed, testbed_dir
from hf_specdec.testbed.workloads import WORKLOAD_NAMES, load_workload

__all__ = ["WORKLOAD_NAMES", "load_testbed", "load_workload", "testbed_dir"]
