"""Anchoring audit checkpoints on a chain (spec §18.4): the backend seam and its backends.

``base`` (the seam, pure), ``encoding`` (the §18.4.1 hashes, pure), ``none`` (signed checkpoints
only), ``evm`` (web3.py; the ``[anchor]`` extra), ``starknet`` (starknet-py; the ``[anchor]``
extra), ``ops`` (plain functions for ``uomp anchor deploy|status``). docs/anchoring.md has the
byte encodings and the operator's guide.
"""
