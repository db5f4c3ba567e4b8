"""The package's settings: one frozen :class:`Config` (``backend``, ``fused_mlp``, ``cuda_plan``, ``prebuilt``),
read from ``GEGLU_<NAME>`` at import; what each does: docs/design.md's Settings. :func:`configure` changes them for
the process, or for a ``with`` block. The kernels read them when they run, never in code that ``torch.compile``
traces, so a change needs no recompilation.
"""

import dataclasses
import os
import warnings
from typing import Optional

BACKENDS = ("auto", "cuda", "triton")
_PLAN_FORMS = ('"" or "auto" (the built-in choice), "<threads>,<unroll>" (threads 32..256, a multiple of 32; unroll '
               '1, 2 or 4) or "<threads>,p<stages>" (stages 2 or 4), e.g. "256,2" or "256,p4"')


def _switch(name: str, setting: Optional[str], default: bool, on: str, off: str) -> bool:
    """An on/off variable: unset or empty is ``default``; 1/on/true/yes or 0/off/false/no (any case, spaces
    stripped); anything else raises ValueError."""
    value = (setting or ("1" if default else "0")).strip().lower()
    if value in ("1", "on", "true", "yes"):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"{name}={setting!r}: expected 1 ({on}{', the default' if default else ''}) or 0 "
                     f"({off}{'' if default else ', the default'}).")


def parse_backend(name: str, what: str) -> str:
    """``name`` as a backend (case and surrounding spaces ignored), or a ValueError naming ``what`` was given."""
    value = name.strip().lower() if isinstance(name, str) else None
    if value not in BACKENDS:
        raise ValueError(f"{what}={name!r} is not a backend; expected one of {', '.join(BACKENDS)}.")
    return value


def parse_cuda_plan(plan: str, what: str) -> str:
    """``plan`` in its canonical form (``""`` for the built-in choice), or a ValueError naming ``what``."""
    value = plan.strip().lower() if isinstance(plan, str) else None
    if value in ("", "auto"):
        return ""
    if value is not None:
        threads, sep, rest = (part.strip() for part in value.partition(","))
        pipelined = rest.startswith("p")
        count = rest[1:] if pipelined else rest
        if sep and threads.strip().isdigit() and count.strip().isdigit():
            t, c = int(threads), int(count)
            if 32 <= t <= 256 and t % 32 == 0 and c in ((2, 4) if pipelined else (1, 2, 4)):
                return f"{t},{'p' if pipelined else ''}{c}"
    raise ValueError(f"{what}={plan!r} is not a launch plan; expected {_PLAN_FORMS}.")


def plan_args(plan: str):
    """(threads, unroll, stages) of a canonical plan for the library's setter; (0, 0, 0) for the built-in choice."""
    if not plan:
        return 0, 0, 0
    threads, rest = plan.split(",")
    return (int(threads), 1, int(rest[1:])) if rest.startswith("p") else (int(threads), int(rest), 0)


@dataclasses.dataclass(frozen=True)
class Config:
    backend: str = "auto"
    fused_mlp: bool = True
    cuda_plan: str = ""
    prebuilt: bool = True

    @classmethod
    def from_env(cls, env=os.environ) -> "Config":
        return cls(
            backend=parse_backend(env.get("GEGLU_BACKEND") or "auto", "GEGLU_BACKEND"),
            fused_mlp=_switch("GEGLU_FUSED_MLP", env.get("GEGLU_FUSED_MLP"), True,
                              "use the fused MLP forward where it is faster", "never"),
            cuda_plan=parse_cuda_plan(env.get("GEGLU_CUDA_PLAN") or "", "GEGLU_CUDA_PLAN"),
            prebuilt=_switch("GEGLU_PREBUILT", env.get("GEGLU_PREBUILT"), True,
                             "launch the kernels this variant ships prebuilt", "Triton's JIT for every Triton kernel"))


current = Config.from_env()

_NO_FUSED_TRAINING = ("the fused_training setting (GEGLU_FUSED_TRAINING) is no longer offered: it did not make a "
                      "model's training step faster (docs/fused-mlp.md), so GeGLUMLP's training step always takes "
                      "its default path. Remove it from your configuration.")
if os.environ.get("GEGLU_FUSED_TRAINING", "").strip():
    warnings.warn(f"geglu: GEGLU_FUSED_TRAINING is set, but {_NO_FUSED_TRAINING}", stacklevel=2)


class _Restore:
    """What :func:`configure` returns: the change is already made; as a context manager it is undone on exit."""

    def __init__(self, previous: Config):
        self._previous = previous

    def __enter__(self) -> Config:
        return current

    def __exit__(self, *exc) -> bool:
        global current
        plan, current = current.cuda_plan, self._previous  # restored first, even if the plan's setter raises
        if plan != current.cuda_plan:
            _apply_plan(current.cuda_plan)
        return False


# The compiled library's launch-plan setter, registered by ``runtime.direct`` (None: none in this variant).
_set_plan = None


def set_plan_hook(setter) -> None:
    """Register the compiled library's launch-plan setter (None for none)."""
    global _set_plan
    _set_plan = setter


def _apply_plan(plan: str) -> None:
    """Hand the launch plan to the compiled library (for every later launch in the process); raises if it has no
    setter (for a non-empty plan) or refuses the plan."""
    if _set_plan is None:
        if plan:
            raise RuntimeError(
                f"geglu.configure(cuda_plan={plan!r}): this build variant has no compiled CUDA library to take a "
                "launch plan (a Triton/CPU variant, or torch without CUDA). Load the torch-stable-abi* variant on a "
                "CUDA machine, or leave cuda_plan unset.")
        return
    status = _set_plan(*plan_args(plan))
    if status:
        raise ValueError(f"geglu.configure(cuda_plan={plan!r}): the compiled library refused the plan "
                         f"(status {status}); expected {_PLAN_FORMS}.")


def configure(**changes) -> _Restore:
    """Change settings (``backend``, ``fused_mlp``, ``cuda_plan``, ``prebuilt``); returns a context manager that
    restores the previous ones. Validates every change (TypeError / ValueError / RuntimeError) before applying any."""
    global current
    unknown = set(changes) - {f.name for f in dataclasses.fields(Config)}
    if "fused_training" in unknown:
        raise TypeError(f"geglu.configure: {_NO_FUSED_TRAINING}")
    if unknown:
        raise TypeError(f"geglu.configure: unknown setting(s) {', '.join(sorted(unknown))}; expected backend, "
                        "fused_mlp, cuda_plan or prebuilt.")
    if "backend" in changes:
        changes["backend"] = parse_backend(changes["backend"], "geglu.configure(backend)")
        if changes["backend"] == "cuda":
            from .._ops import HAS_CUDA_LIB
            if not HAS_CUDA_LIB:
                raise RuntimeError(
                    "geglu.configure(backend='cuda'): this build variant has no compiled CUDA library (it is a "
                    "Triton/CPU variant). Load the torch-stable-abi* variant, or use 'triton' / 'auto'.")
    for name in ("fused_mlp", "prebuilt"):
        if name in changes and not isinstance(changes[name], bool):
            raise TypeError(f"geglu.configure({name}={changes[name]!r}): expected True or False.")
    if "cuda_plan" in changes:
        changes["cuda_plan"] = parse_cuda_plan(changes["cuda_plan"], "geglu.configure(cuda_plan)")
        if changes["cuda_plan"] != current.cuda_plan:
            _apply_plan(changes["cuda_plan"])  # raises before anything changed
    previous = current
    current = dataclasses.replace(current, **changes)
    return _Restore(previous)


def get_config() -> Config:
    """The settings in force (a frozen :class:`Config`)."""
    return current
