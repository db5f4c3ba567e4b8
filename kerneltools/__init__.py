"""Tooling for the GeGLU kernel package: builder, loopback Hub server, publisher, demo, benchmarks.

Run ``python -m kerneltools --help`` for the subcommands.
"""
