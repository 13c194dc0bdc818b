"""The verifiable audit log: Merkle event log, checkpoints, proofs, verify, the witness, anchoring."""
