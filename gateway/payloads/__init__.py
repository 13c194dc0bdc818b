"""The payload relay: the ciphertext store, the pull journal and the user's payload key."""
