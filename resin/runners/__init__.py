"""Runners: what computes a model for the engine, one package per backend.

``resin.runners.torch`` is the torch reference runner, the one every other runner is
compared with by the parity harness. Importing this package imports no backend.
"""
