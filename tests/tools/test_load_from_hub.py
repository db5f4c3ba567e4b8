"""The real kernel end to end: built by kerneltools.build, published to the loopback Hub by kerneltools.publish,
loaded by kernels' get_kernel in a fresh process (on this CPU machine it picks torch-cpu), listed by kernels' CLI.
test_publish.py covers the publisher itself on a synthetic kernel."""

from __future__ import annotations

from toolhelpers import GEGLU_PROBE, GEGLU_REPO, KERNELS_CLI, kernels_env, run_cli, run_kernels


def test_versions_load_from_hub(hub, tmp_path, geglu_builds):
    v1, v2 = geglu_builds.v1, geglu_builds.v2
    r1 = v1.publish(hub)
    r2 = v2.publish(hub)
    assert (r1.branch, r2.branch) == ("v1", "v2") and r1.variants == r2.variants == ["torch-cpu", "torch-cuda"]
    assert v1.ids["torch-cpu"] != v2.ids["torch-cpu"]  # a new version is a new module, loadable side by side

    out = run_kernels(hub.url, tmp_path, prelude=GEGLU_PROBE, body=f"""
    from kernels import get_kernel
    out["v1"] = describe(get_kernel({GEGLU_REPO!r}, version=1))
    out["v2"] = describe(get_kernel({GEGLU_REPO!r}, version=2))
    out["v2_version"] = get_kernel({GEGLU_REPO!r}, version=2).__name__  # loaded once per process
    """)
    assert out["v1"] == {"id": v1.ids["torch-cpu"], "commit": r1.commit, "variant": "torch-cpu", "exact": True}
    assert out["v2"] == {"id": v2.ids["torch-cpu"], "commit": r2.commit, "variant": "torch-cpu", "exact": True}
    assert out["v2_version"] == v2.ids["torch-cpu"]
    assert f"You are using version 1 of '{GEGLU_REPO}', but version 2 is available." in out["_stderr"]

    env = kernels_env(hub.url, tmp_path)
    r = run_cli([KERNELS_CLI, "versions", GEGLU_REPO], env)
    assert r.returncode == 0, r.stderr
    for version in ("Version 1:", "Version 2:"):
        block = r.stdout.split(version, 1)[1].split("Version ", 1)[0]
        assert "torch-cpu compatible, preferred" in block
        assert "torch-cuda: backend (cuda) does not match system backend (cpu)" in block
    r = run_cli([KERNELS_CLI, "info", GEGLU_REPO, "--version", "1"], env)
    assert r.returncode == 0, r.stderr
    for line in ("Repository: geglu-kernels/geglu", "Revision: v1", "Name: geglu", "Version: 1",
                 "License: Apache-2.0", "Backends: cpu, cuda"):
        assert line in r.stdout.splitlines(), r.stdout
