"""Agent registries (spec §17): finding agents on an ERC-8004 Identity Registry and fetching their files.

``chain.py`` reads the registry over JSON-RPC, ``fetch.py`` fetches one document under fixed
rules (https, public addresses, bounded size, time and redirects), ``card.py`` validates the
ERC-8004 registration file, ``ops.py`` is what ``uomp registry`` does. A registry never takes
part in an authorization decision (§17.2): install only fetches and verifies.
"""
