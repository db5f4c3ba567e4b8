"""PLACEHOLDER kernel package for the cuda branch's tests (the real one, Triton + CPU + custom ops, is written
on main and replaces this file on merge). It only exposes the compiled ops of the variant it ships in."""

from ._ops import HAS_CUDA_LIB, add_op_namespace_prefix, ops

__all__ = ["HAS_CUDA_LIB", "add_op_namespace_prefix", "ops"]
