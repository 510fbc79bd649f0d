'use strict';
// Block keys, from the contract alone (kvstore.proto's header; key_vectors.json):
//   key[-1] = SHA-256("kvstore/v1" || UTF-8 namespace)      (the vectors call it "root")
//   key[i]  = SHA-256(key[i-1] || the block_size token ids of block i, each a little-endian uint32)
// Only full blocks have keys; a trailing partial block has none. No seeds: the same tokens give
// the same keys in every process, host and language.

const crypto = require('node:crypto');

const KEY_BYTES = 32;
const MAX_NAMESPACE_BYTES = 256;
const DOMAIN = Buffer.from('kvstore/v1', 'utf8');
const MAX_TOKEN = 0xffffffff;

function namespaceRoot(namespace) {
  if (typeof namespace !== 'string') {
    throw new TypeError(`namespace must be a string, got ${typeof namespace}`);
  }
  const bytes = Buffer.from(namespace, 'utf8');
  if (bytes.length === 0 || bytes.length > MAX_NAMESPACE_BYTES) {
    throw new RangeError(`namespace is ${bytes.length} bytes; it must be 1..${MAX_NAMESPACE_BYTES}`);
  }
  return crypto.createHash('sha256').update(DOMAIN).update(bytes).digest();
}

function chainKey(parent, blockTokens) {
  const tokens = Buffer.alloc(4 * blockTokens.length);
  blockTokens.forEach((token, i) => {
    if (!Number.isInteger(token) || token < 0 || token > MAX_TOKEN) {
      throw new RangeError(`tokens[${i}] is ${token}; token ids are uint32 (0..${MAX_TOKEN})`);
    }
    tokens.writeUInt32LE(token, 4 * i);
  });
  return crypto.createHash('sha256').update(parent).update(tokens).digest();
}

// The keys of every full block of `tokens`, root first (a prefix chain).
function blockKeys(namespace, tokens, blockSize) {
  if (!Number.isInteger(blockSize) || blockSize < 1) {
    throw new RangeError(`block_size is ${blockSize}; it must be a positive integer`);
  }
  const keys = [];
  let parent = namespaceRoot(namespace);
  for (let start = 0; start + blockSize <= tokens.length; start += blockSize) {
    parent = chainKey(parent, tokens.slice(start, start + blockSize));
    keys.push(parent);
  }
  return keys;
}

module.exports = { KEY_BYTES, MAX_NAMESPACE_BYTES, namespaceRoot, chainKey, blockKeys };
