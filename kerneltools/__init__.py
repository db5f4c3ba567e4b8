"""Tooling for the GeGLU kernel repository: variant builder, loopback Hub server, publisher, demo, benchmarks.

Nothing here ships in the kernel; the kernel package (torch-ext/geglu) never imports it.
"""
