"""Models and prompts to measure speculation on: a small trained code-model family (tokenizer, target, draft),
trained on the Python standard library by ``examples/train_testbed.py`` and committed under ``examples/testbed``;
and a real pretrained model, SmolLM2-135M-Instruct, fetched from a package registry (``load_real_model``).
"""

from hf_specdec.testbed.loading import load_testbed, testbed_dir
from hf_specdec.testbed.real_model import ModelSourceError, load_real_model
from hf_specdec.testbed.workloads import WORKLOAD_NAMES, load_workload

__all__ = ["WORKLOAD_NAMES", "ModelSourceError", "load_real_model", "load_testbed", "load_workload", "testbed_dir"]
