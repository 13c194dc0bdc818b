// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

interface IIdentityRegistry {
    function ownerOf(uint256 agentId) external view returns (address);
    function isApprovedForAll(address owner, address operator) external view returns (bool);
    function getApproved(uint256 agentId) external view returns (address);
}

/// @title A minimal ERC-8004 Reputation Registry
/// @notice The feedback interface of ERC-8004 (giveFeedback, revokeFeedback, readFeedback,
///         getSummary, getLastIndex, getClients, the NewFeedback / FeedbackRevoked events) over an
///         Identity Registry given at deployment. The UOMP appliance's test registry: what
///         `uomp registry report` writes to when the user opts in (spec §19.5).
/// @dev Feedback is by any address but the agent's owner or operators; value is a signed
///      fixed-point number with valueDecimals (0-18) decimals.
contract Erc8004ReputationRegistry {
    struct Feedback {
        int128 value;
        uint8 valueDecimals;
        bool isRevoked;
        string tag1;
        string tag2;
    }

    event NewFeedback(
        uint256 indexed agentId,
        address indexed clientAddress,
        uint64 feedbackIndex,
        int128 value,
        uint8 valueDecimals,
        string indexed indexedTag1,
        string tag1,
        string tag2,
        string endpoint,
        string feedbackURI,
        bytes32 feedbackHash
    );
    event FeedbackRevoked(uint256 indexed agentId, address indexed clientAddress, uint64 indexed feedbackIndex);

    error NoSuchAgent(uint256 agentId);
    error SelfFeedback(uint256 agentId);
    error BadDecimals(uint8 valueDecimals);
    error NoSuchFeedback(uint256 agentId, address clientAddress, uint64 feedbackIndex);

    IIdentityRegistry private immutable _identity;
    mapping(uint256 => mapping(address => mapping(uint64 => Feedback))) private _feedback;
    mapping(uint256 => mapping(address => uint64)) private _lastIndex;
    mapping(uint256 => address[]) private _clients;

    constructor(address identityRegistry) {
        _identity = IIdentityRegistry(identityRegistry);
    }

    function getIdentityRegistry() external view returns (address) {
        return address(_identity);
    }

    function giveFeedback(
        uint256 agentId,
        int128 value,
        uint8 valueDecimals,
        string calldata tag1,
        string calldata tag2,
        string calldata endpoint,
        string calldata feedbackURI,
        bytes32 feedbackHash
    ) external returns (uint64 feedbackIndex) {
        if (valueDecimals > 18) revert BadDecimals(valueDecimals);
        address owner;
        try _identity.ownerOf(agentId) returns (address o) {
            owner = o;
        } catch {
            revert NoSuchAgent(agentId);
        }
        if (
            msg.sender == owner || _identity.isApprovedForAll(owner, msg.sender)
                || _identity.getApproved(agentId) == msg.sender
        ) revert SelfFeedback(agentId);
        feedbackIndex = _lastIndex[agentId][msg.sender] + 1;
        if (feedbackIndex == 1) _clients[agentId].push(msg.sender);
        _lastIndex[agentId][msg.sender] = feedbackIndex;
        _feedback[agentId][msg.sender][feedbackIndex] = Feedback(value, valueDecimals, false, tag1, tag2);
        emit NewFeedback(
            agentId, msg.sender, feedbackIndex, value, valueDecimals, tag1, tag1, tag2, endpoint, feedbackURI, feedbackHash
        );
    }

    function revokeFeedback(uint256 agentId, uint64 feedbackIndex) external {
        if (feedbackIndex == 0 || feedbackIndex > _lastIndex[agentId][msg.sender]) {
            revert NoSuchFeedback(agentId, msg.sender, feedbackIndex);
        }
        _feedback[agentId][msg.sender][feedbackIndex].isRevoked = true;
        emit FeedbackRevoked(agentId, msg.sender, feedbackIndex);
    }

    function readFeedback(uint256 agentId, address clientAddress, uint64 feedbackIndex)
        external
        view
        returns (int128 value, uint8 valueDecimals, string memory tag1, string memory tag2, bool isRevoked)
    {
        if (feedbackIndex == 0 || feedbackIndex > _lastIndex[agentId][clientAddress]) {
            revert NoSuchFeedback(agentId, clientAddress, feedbackIndex);
        }
        Feedback storage f = _feedback[agentId][clientAddress][feedbackIndex];
        return (f.value, f.valueDecimals, f.tag1, f.tag2, f.isRevoked);
    }

    function getLastIndex(uint256 agentId, address clientAddress) external view returns (uint64) {
        return _lastIndex[agentId][clientAddress];
    }

    function getClients(uint256 agentId) external view returns (address[] memory) {
        return _clients[agentId];
    }

    /// @notice Count and mean (at 18 decimals) of the non-revoked feedback of the given clients
    ///         whose tags match (an empty tag matches any).
    function getSummary(uint256 agentId, address[] calldata clientAddresses, string calldata tag1, string calldata tag2)
        external
        view
        returns (uint64 count, int128 summaryValue, uint8 summaryValueDecimals)
    {
        int256 total;
        bytes32 t1 = keccak256(bytes(tag1));
        bytes32 t2 = keccak256(bytes(tag2));
        for (uint256 c = 0; c < clientAddresses.length; c++) {
            uint64 last = _lastIndex[agentId][clientAddresses[c]];
            for (uint64 i = 1; i <= last; i++) {
                Feedback storage f = _feedback[agentId][clientAddresses[c]][i];
                if (f.isRevoked) continue;
                if (bytes(tag1).length > 0 && keccak256(bytes(f.tag1)) != t1) continue;
                if (bytes(tag2).length > 0 && keccak256(bytes(f.tag2)) != t2) continue;
                total += int256(f.value) * int256(10 ** (18 - uint256(f.valueDecimals)));
                count++;
            }
        }
        if (count > 0) summaryValue = int128(total / int256(uint256(count)));
        summaryValueDecimals = 18;
    }
}
