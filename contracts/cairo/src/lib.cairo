// SPDX-License-Identifier: Apache-2.0
//
// UOMP audit anchor for Starknet (spec draft-00 §18.4): the Cairo twin of contracts/UompAnchor.sol.
// Records signed audit-log checkpoints (RFC 9162 roots) and the §18.4.1 events of the appliance
// that owns it. Only hashes: never a memory key, value or payload plaintext (docs/anchoring.md).
//
// NOT COMPILED in this repository (no Cairo compiler installs from the registries we use); the
// Python backend (gateway/anchor/starknet.py) builds its calldata and decodes its events from the
// layout below, and was tested only against a local stand-in JSON-RPC server, never a real node.
//
// Types: every 32-byte hash is a u256 (two felts on the wire: low 128 bits, then high);
// tree_size and expires_at are u64 (the EVM contract's expiresAt is a uint256: the value is the
// same Unix time); allowed is a bool (felt 0 or 1).

#[derive(Copy, Drop, Serde)]
pub struct Granted {
    pub session_hash: u256,
    pub agent_hash: u256,
    pub expires_at: u64,
}

#[derive(Copy, Drop, Serde)]
pub struct Revoked {
    pub session_hash: u256,
    pub agent_hash: u256,
}

#[derive(Copy, Drop, Serde)]
pub struct Access {
    pub session_hash: u256,
    pub agent_hash: u256,
    pub endpoint_hash: u256,
    pub allowed: bool,
}

#[derive(Copy, Drop, Serde)]
pub struct Payload {
    pub payload_hash: u256,
    pub session_hash: u256,
    pub agent_hash: u256,
}

#[derive(Copy, Drop, Serde)]
pub struct Deletion {
    pub session_hash: u256,
    pub agent_hash: u256,
    pub deletion_proof_hash: u256,
}

#[starknet::interface]
pub trait IUompAnchor<TContractState> {
    /// Anchor one checkpoint (at most once) and the events it covers; emitted in argument order
    /// (granted, revoked, access, payloads, deletions), then CheckpointAnchored.
    fn anchor(
        ref self: TContractState,
        root: u256,
        tree_size: u64,
        checkpoint_hash: u256,
        granted: Array<Granted>,
        revoked: Array<Revoked>,
        access: Array<Access>,
        payloads: Array<Payload>,
        deletions: Array<Deletion>,
    );
    /// The block that anchored `checkpoint_hash`, 0 if none did.
    fn anchored_block(self: @TContractState, checkpoint_hash: u256) -> u64;
    fn owner(self: @TContractState) -> starknet::ContractAddress;
    fn transfer_ownership(ref self: TContractState, new_owner: starknet::ContractAddress);
}

#[starknet::contract]
pub mod UompAnchor {
    use core::num::traits::Zero;
    use starknet::storage::{
        Map, StorageMapReadAccess, StorageMapWriteAccess, StoragePointerReadAccess,
        StoragePointerWriteAccess,
    };
    use starknet::{ContractAddress, get_block_number, get_caller_address};
    use super::{Access, Deletion, Granted, Payload, Revoked};

    #[storage]
    struct Storage {
        owner: ContractAddress,
        anchored_block: Map<u256, u64>,
    }

    // Each event's first key is the selector of its name (sn_keccak), then its #[key] fields;
    // its data are the other fields, in declaration order.
    #[event]
    #[derive(Drop, starknet::Event)]
    pub enum Event {
        SessionGranted: SessionGranted,
        SessionRevoked: SessionRevoked,
        GatewayAccess: GatewayAccess,
        PayloadAnchored: PayloadAnchored,
        DataDeletionProofSubmitted: DataDeletionProofSubmitted,
        CheckpointAnchored: CheckpointAnchored,
        OwnershipTransferred: OwnershipTransferred,
    }

    #[derive(Drop, starknet::Event)]
    pub struct SessionGranted {
        #[key]
        pub session_hash: u256,
        #[key]
        pub agent_hash: u256,
        pub expires_at: u64,
    }

    #[derive(Drop, starknet::Event)]
    pub struct SessionRevoked {
        #[key]
        pub session_hash: u256,
        #[key]
        pub agent_hash: u256,
    }

    #[derive(Drop, starknet::Event)]
    pub struct GatewayAccess {
        #[key]
        pub session_hash: u256,
        #[key]
        pub agent_hash: u256,
        pub endpoint_hash: u256,
        pub allowed: bool,
    }

    #[derive(Drop, starknet::Event)]
    pub struct PayloadAnchored {
        #[key]
        pub payload_hash: u256,
        #[key]
        pub session_hash: u256,
        pub agent_hash: u256,
    }

    #[derive(Drop, starknet::Event)]
    pub struct DataDeletionProofSubmitted {
        #[key]
        pub session_hash: u256,
        #[key]
        pub agent_hash: u256,
        pub deletion_proof_hash: u256,
    }

    #[derive(Drop, starknet::Event)]
    pub struct CheckpointAnchored {
        pub root: u256,
        pub tree_size: u64,
        #[key]
        pub checkpoint_hash: u256,
    }

    #[derive(Drop, starknet::Event)]
    pub struct OwnershipTransferred {
        #[key]
        pub previous_owner: ContractAddress,
        #[key]
        pub new_owner: ContractAddress,
    }

    #[constructor]
    fn constructor(ref self: ContractState, owner: ContractAddress) {
        assert(!owner.is_zero(), 'ZERO_ADDRESS');
        self.owner.write(owner);
        self.emit(OwnershipTransferred { previous_owner: Zero::zero(), new_owner: owner });
    }

    #[abi(embed_v0)]
    impl UompAnchorImpl of super::IUompAnchor<ContractState> {
        fn anchor(
            ref self: ContractState,
            root: u256,
            tree_size: u64,
            checkpoint_hash: u256,
            granted: Array<Granted>,
            revoked: Array<Revoked>,
            access: Array<Access>,
            payloads: Array<Payload>,
            deletions: Array<Deletion>,
        ) {
            assert(get_caller_address() == self.owner.read(), 'NOT_OWNER');
            assert(self.anchored_block.read(checkpoint_hash) == 0, 'ALREADY_ANCHORED');
            self.anchored_block.write(checkpoint_hash, get_block_number());
            for g in granted {
                self.emit(SessionGranted {
                    session_hash: g.session_hash, agent_hash: g.agent_hash, expires_at: g.expires_at,
                });
            };
            for r in revoked {
                self.emit(SessionRevoked { session_hash: r.session_hash, agent_hash: r.agent_hash });
            };
            for a in access {
                self.emit(GatewayAccess {
                    session_hash: a.session_hash,
                    agent_hash: a.agent_hash,
                    endpoint_hash: a.endpoint_hash,
                    allowed: a.allowed,
                });
            };
            for p in payloads {
                self.emit(PayloadAnchored {
                    payload_hash: p.payload_hash, session_hash: p.session_hash, agent_hash: p.agent_hash,
                });
            };
            for d in deletions {
                self.emit(DataDeletionProofSubmitted {
                    session_hash: d.session_hash,
                    agent_hash: d.agent_hash,
                    deletion_proof_hash: d.deletion_proof_hash,
                });
            };
            self.emit(CheckpointAnchored { root, tree_size, checkpoint_hash });
        }

        fn anchored_block(self: @ContractState, checkpoint_hash: u256) -> u64 {
            self.anchored_block.read(checkpoint_hash)
        }

        fn owner(self: @ContractState) -> ContractAddress {
            self.owner.read()
        }

        fn transfer_ownership(ref self: ContractState, new_owner: ContractAddress) {
            assert(get_caller_address() == self.owner.read(), 'NOT_OWNER');
            assert(!new_owner.is_zero(), 'ZERO_ADDRESS');
            let previous_owner = self.owner.read();
            self.owner.write(new_owner);
            self.emit(OwnershipTransferred { previous_owner, new_owner });
        }
    }
}
