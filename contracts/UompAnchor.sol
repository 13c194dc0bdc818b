// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

/// @title UOMP audit anchor (spec draft-00 §18.4)
/// @notice Records signed audit-log checkpoints (RFC 9162 Merkle roots) and the §18.4.1 events
///         of the UOMP gateway appliance that owns this contract. Only hashes reach the chain:
///         no memory key, value or payload plaintext is ever an argument (docs/anchoring.md
///         gives the exact byte encoding of every hash).
/// @dev One checkpoint is anchored at most once: its checkpointHash (SHA-256 of the signed
///      checkpoint note) is the anchor's id, so a resubmission after a crash reverts instead of
///      writing a second record, and `anchoredBlock` tells an appliance where the first one is.
contract UompAnchor {
    // §18.4.1, verbatim.
    event SessionGranted(bytes32 indexed sessionHash, bytes32 indexed agentHash, uint256 expiresAt);
    event SessionRevoked(bytes32 indexed sessionHash, bytes32 indexed agentHash);
    event GatewayAccess(bytes32 indexed sessionHash, bytes32 indexed agentHash, bytes32 endpointHash, bool allowed);
    event PayloadAnchored(bytes32 indexed payloadHash, bytes32 indexed sessionHash, bytes32 agentHash);
    event DataDeletionProofSubmitted(bytes32 indexed sessionHash, bytes32 indexed agentHash, bytes32 deletionProofHash);

    // The batch root: emitted last in every anchoring transaction.
    event CheckpointAnchored(bytes32 root, uint64 treeSize, bytes32 indexed checkpointHash);

    event OwnershipTransferred(address indexed previousOwner, address indexed newOwner);

    struct Granted {
        bytes32 sessionHash;
        bytes32 agentHash;
        uint256 expiresAt;
    }

    struct Revoked {
        bytes32 sessionHash;
        bytes32 agentHash;
    }

    struct Access {
        bytes32 sessionHash;
        bytes32 agentHash;
        bytes32 endpointHash;
        bool allowed;
    }

    struct Payload {
        bytes32 payloadHash;
        bytes32 sessionHash;
        bytes32 agentHash;
    }

    struct Deletion {
        bytes32 sessionHash;
        bytes32 agentHash;
        bytes32 deletionProofHash;
    }

    error NotOwner();
    error ZeroAddress();
    error AlreadyAnchored(bytes32 checkpointHash, uint256 blockNumber);

    address public owner;

    /// checkpointHash => number of the block that anchored it (0: never anchored).
    mapping(bytes32 => uint256) public anchoredBlock;

    constructor() {
        owner = msg.sender;
        emit OwnershipTransferred(address(0), msg.sender);
    }

    modifier onlyOwner() {
        if (msg.sender != owner) revert NotOwner();
        _;
    }

    function transferOwnership(address newOwner) external onlyOwner {
        if (newOwner == address(0)) revert ZeroAddress();
        emit OwnershipTransferred(owner, newOwner);
        owner = newOwner;
    }

    /// @notice Anchor one signed checkpoint and the §18.4.1 events it covers. The events are
    ///         emitted in argument order (granted, revoked, access, payload, deletion), then
    ///         CheckpointAnchored.
    function anchor(
        bytes32 root,
        uint64 treeSize,
        bytes32 checkpointHash,
        Granted[] calldata granted,
        Revoked[] calldata revoked,
        Access[] calldata access,
        Payload[] calldata payloads,
        Deletion[] calldata deletions
    ) external onlyOwner {
        uint256 seen = anchoredBlock[checkpointHash];
        if (seen != 0) revert AlreadyAnchored(checkpointHash, seen);
        anchoredBlock[checkpointHash] = block.number;
        for (uint256 i = 0; i < granted.length; ++i) {
            emit SessionGranted(granted[i].sessionHash, granted[i].agentHash, granted[i].expiresAt);
        }
        for (uint256 i = 0; i < revoked.length; ++i) {
            emit SessionRevoked(revoked[i].sessionHash, revoked[i].agentHash);
        }
        for (uint256 i = 0; i < access.length; ++i) {
            emit GatewayAccess(access[i].sessionHash, access[i].agentHash, access[i].endpointHash, access[i].allowed);
        }
        for (uint256 i = 0; i < payloads.length; ++i) {
            emit PayloadAnchored(payloads[i].payloadHash, payloads[i].sessionHash, payloads[i].agentHash);
        }
        for (uint256 i = 0; i < deletions.length; ++i) {
            emit DataDeletionProofSubmitted(deletions[i].sessionHash, deletions[i].agentHash, deletions[i].deletionProofHash);
        }
        emit CheckpointAnchored(root, treeSize, checkpointHash);
    }
}
