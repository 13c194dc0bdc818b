// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

/// @title A minimal ERC-8004 Identity Registry (an ERC-721 with URI storage and on-chain metadata)
/// @notice What `uomp registry` reads: agents are ERC-721 tokens whose tokenURI is the agent's
///         registration file. This contract is the test registry of the UOMP appliance: it follows
///         the ERC-8004 Identity Registry interface (register overloads, setAgentURI, getMetadata,
///         setMetadata, the Registered / URIUpdated / MetadataSet events) on a self-contained
///         ERC-721 core, so that it compiles offline with the pinned solc and no libraries.
/// @dev agentIds are assigned incrementally from 1. The owner of a token, or an operator it
///      approved, manages its URI and metadata; the reserved metadata key "agentWallet" is left
///      to the registry's own wallet flow and cannot be set through setMetadata.
contract Erc8004IdentityRegistry {
    struct MetadataEntry {
        string metadataKey;
        bytes metadataValue;
    }

    // ERC-721
    event Transfer(address indexed from, address indexed to, uint256 indexed tokenId);
    event Approval(address indexed owner, address indexed approved, uint256 indexed tokenId);
    event ApprovalForAll(address indexed owner, address indexed operator, bool approved);
    // ERC-8004 Identity Registry
    event Registered(uint256 indexed agentId, string agentURI, address indexed owner);
    event URIUpdated(uint256 indexed agentId, string newURI, address indexed updatedBy);
    event MetadataSet(
        uint256 indexed agentId, string indexed indexedMetadataKey, string metadataKey, bytes metadataValue
    );

    error NotAuthorized(uint256 agentId, address caller);
    error NoSuchAgent(uint256 agentId);
    error ZeroAddress();
    error WrongOwner(uint256 tokenId, address from);
    error ReservedKey(string metadataKey);
    error UnsafeRecipient(address to);

    string public constant name = "ERC-8004 Agent Identity";
    string public constant symbol = "AGENT";

    uint256 private _nextId = 1;
    mapping(uint256 => address) private _owners;
    mapping(address => uint256) private _balances;
    mapping(uint256 => address) private _approved;
    mapping(address => mapping(address => bool)) private _operators;
    mapping(uint256 => string) private _uris;
    mapping(uint256 => mapping(string => bytes)) private _metadata;

    // ---------------------------------------------------------------- ERC-165

    function supportsInterface(bytes4 interfaceId) external pure returns (bool) {
        return interfaceId == 0x01ffc9a7 // ERC-165
            || interfaceId == 0x80ac58cd // ERC-721
            || interfaceId == 0x5b5e139f; // ERC-721 Metadata
    }

    // ---------------------------------------------------------------- ERC-8004 registration

    function register(string calldata agentURI, MetadataEntry[] calldata metadata) external returns (uint256 agentId) {
        agentId = _mint(msg.sender, agentURI);
        for (uint256 i = 0; i < metadata.length; i++) {
            _setMetadata(agentId, metadata[i].metadataKey, metadata[i].metadataValue);
        }
    }

    function register(string calldata agentURI) external returns (uint256 agentId) {
        agentId = _mint(msg.sender, agentURI);
    }

    function register() external returns (uint256 agentId) {
        agentId = _mint(msg.sender, "");
    }

    function setAgentURI(uint256 agentId, string calldata newURI) external {
        _requireManager(agentId);
        _uris[agentId] = newURI;
        emit URIUpdated(agentId, newURI, msg.sender);
    }

    function getMetadata(uint256 agentId, string memory metadataKey) external view returns (bytes memory) {
        return _metadata[agentId][metadataKey];
    }

    function setMetadata(uint256 agentId, string memory metadataKey, bytes memory metadataValue) external {
        _requireManager(agentId);
        _setMetadata(agentId, metadataKey, metadataValue);
    }

    /// @notice The number of agents registered so far (agentIds are 1..totalAgents()).
    function totalAgents() external view returns (uint256) {
        return _nextId - 1;
    }

    // ---------------------------------------------------------------- ERC-721

    function balanceOf(address owner) external view returns (uint256) {
        if (owner == address(0)) revert ZeroAddress();
        return _balances[owner];
    }

    function ownerOf(uint256 tokenId) public view returns (address owner) {
        owner = _owners[tokenId];
        if (owner == address(0)) revert NoSuchAgent(tokenId);
    }

    function tokenURI(uint256 tokenId) external view returns (string memory) {
        ownerOf(tokenId);
        return _uris[tokenId];
    }

    function approve(address to, uint256 tokenId) external {
        address owner = ownerOf(tokenId);
        if (msg.sender != owner && !_operators[owner][msg.sender]) revert NotAuthorized(tokenId, msg.sender);
        _approved[tokenId] = to;
        emit Approval(owner, to, tokenId);
    }

    function getApproved(uint256 tokenId) external view returns (address) {
        ownerOf(tokenId);
        return _approved[tokenId];
    }

    function setApprovalForAll(address operator, bool approved) external {
        _operators[msg.sender][operator] = approved;
        emit ApprovalForAll(msg.sender, operator, approved);
    }

    function isApprovedForAll(address owner, address operator) external view returns (bool) {
        return _operators[owner][operator];
    }

    function transferFrom(address from, address to, uint256 tokenId) public {
        if (to == address(0)) revert ZeroAddress();
        address owner = ownerOf(tokenId);
        if (owner != from) revert WrongOwner(tokenId, from);
        if (!_isManager(owner, tokenId, msg.sender)) revert NotAuthorized(tokenId, msg.sender);
        delete _approved[tokenId];
        _balances[from] -= 1;
        _balances[to] += 1;
        _owners[tokenId] = to;
        emit Transfer(from, to, tokenId);
    }

    function safeTransferFrom(address from, address to, uint256 tokenId) external {
        safeTransferFrom(from, to, tokenId, "");
    }

    function safeTransferFrom(address from, address to, uint256 tokenId, bytes memory data) public {
        transferFrom(from, to, tokenId);
        if (to.code.length > 0) {
            (bool ok, bytes memory ret) = to.call(
                abi.encodeWithSelector(0x150b7a02, msg.sender, from, tokenId, data) // onERC721Received
            );
            if (!ok || ret.length != 32 || abi.decode(ret, (bytes4)) != bytes4(0x150b7a02)) {
                revert UnsafeRecipient(to);
            }
        }
    }

    // ---------------------------------------------------------------- internals

    function _mint(address to, string memory agentURI) private returns (uint256 agentId) {
        agentId = _nextId++;
        _owners[agentId] = to;
        _balances[to] += 1;
        _uris[agentId] = agentURI;
        emit Transfer(address(0), to, agentId);
        emit Registered(agentId, agentURI, to);
    }

    function _setMetadata(uint256 agentId, string memory metadataKey, bytes memory metadataValue) private {
        if (keccak256(bytes(metadataKey)) == keccak256("agentWallet")) revert ReservedKey(metadataKey);
        _metadata[agentId][metadataKey] = metadataValue;
        emit MetadataSet(agentId, metadataKey, metadataKey, metadataValue);
    }

    function _isManager(address owner, uint256 tokenId, address who) private view returns (bool) {
        return who == owner || _approved[tokenId] == who || _operators[owner][who];
    }

    function _requireManager(uint256 agentId) private view {
        address owner = ownerOf(agentId);
        if (!_isManager(owner, agentId, msg.sender)) revert NotAuthorized(agentId, msg.sender);
    }
}
