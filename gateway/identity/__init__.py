"""Publisher verification beyond did:key (spec §16.2-16.4): did:web, X.509 and OpenPGP.

Each method proves who signed a manifest; :mod:`gateway.identity.verify` turns that into the three
states ``uomp authorize`` shows (verified against your trust list / signed by an identity you never
trusted / unverified, with the reason). Nothing is reported verified before its check passed.
"""
