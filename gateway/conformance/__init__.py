"""A black-box UOMP conformance suite: runs over HTTP(S) against any guard or gateway.

It imports nothing from :mod:`gateway.guard` or :mod:`gateway.remote`: what it knows of the target
is what the setup contract (docs/conformance.md) gives it. Entry points: :func:`run` in
:mod:`gateway.conformance.suite`; output in :mod:`gateway.conformance.report`.
"""
