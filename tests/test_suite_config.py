"""The test run's own configuration: the skip summary (tests/conftest.py) and pyproject.toml's warning filters."""

import tomllib
import warnings
from pathlib import Path
from types import SimpleNamespace

from tests import conftest

ROOT = Path(__file__).resolve().parents[1]


class _Reporter:
    def __init__(self, skipped):
        self.stats = {"skipped": skipped} if skipped is not None else {}
        self.lines = []

    def write_sep(self, sep, title):
        self.lines.append(f"[{title}]")

    def write_line(self, line):
        self.lines.append(line)


def _skip(reason, path="tests/x.py", line=1):
    return SimpleNamespace(longrepr=(path, line, f"Skipped: {reason}"))


def test_skips_are_summarised_one_line_per_reason():
    skipped = [_skip("needs a CUDA GPU", line=i) for i in range(5)] + [_skip("no nvcc"), _skip("no nvcc", "y.py")]
    rep = _Reporter(skipped)
    conftest.pytest_terminal_summary(rep)
    assert rep.lines == ["[skipped, by reason]", "    5  needs a CUDA GPU", "    2  no nvcc"]


def test_no_skip_summary_without_skips():
    for skipped in (None, []):
        rep = _Reporter(skipped)
        conftest.pytest_terminal_summary(rep)
        assert rep.lines == []


def _method(self) -> int:
    return 1


def test_torch_jit_warning_filter_matches_the_warning_torch_raises():
    """The filter for PyTorch's torch.jit.script_method deprecation still matches what torch says: when torch
    changes the text or the module, this fails and the filter in pyproject.toml is to be updated (or dropped)."""
    import torch
    from _pytest.config import parse_warning_filter

    filters = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["filterwarnings"]
    ours = [parse_warning_filter(f, escape=False) for f in filters if "script_method" in f]
    assert len(ours) == 1
    action, message, category, module, _ = ours[0]

    def script_method_warnings(*filter_args):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if filter_args:
                warnings.filterwarnings(*filter_args)
            torch.jit.script_method(_method)
        return [str(w.message) for w in caught if "script_method" in str(w.message)]

    if not script_method_warnings():
        raise AssertionError("torch.jit.script_method no longer warns: remove its filter from pyproject.toml")
    assert script_method_warnings(action, message, category, module) == [], \
        f"pyproject.toml's filter {ours[0]} no longer matches torch's warning: {script_method_warnings()}"
