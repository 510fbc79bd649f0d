'use strict';
// A minimal kvstore.v1 client, written from the wire contract (proto/kvstore/v1/kvstore.proto)
// alone. It owns: dialing (a target without a port means 50051), the bearer token a daemon with
// auth.mode=token wants on every call, asking Limits once and sizing the channel from it, the
// Put framing, both Get modes (INLINE bytes, SHARED_MEMORY extents read
// from the segment under a lease), Lookup, Prefetch, Evict, Release, Stats, and turning a
// failed call into a KVStoreError carrying the google.rpc.ErrorInfo the daemon attached.

const fs = require('node:fs');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');
const { xxhash3 } = require('hash-wasm');

const HERE = __dirname;
const CONTRACT_DIR = path.resolve(HERE, '..', '..', 'proto');  // kvstore/v1/kvstore.proto
const RPC_DIR = path.join(HERE, 'proto');                      // google/rpc/*.proto, bundled
const DEFAULT_PORT = 50051;
const ERROR_DOMAIN = 'kvstore.v1';
const DETAILS_TRAILER = 'grpc-status-details-bin';
const ERROR_INFO_TYPE = 'type.googleapis.com/google.rpc.ErrorInfo';
// auth.mode=token: every call carries the metadata `authorization: Bearer <token>`. Where the
// token comes from, in this order (the Python client's order too): the `token` option, the
// environment variable KVSTORE_TOKEN, the file KVSTORE_TOKEN_FILE names (a mounted Secret).
const ENV_TOKEN = 'KVSTORE_TOKEN';
const ENV_TOKEN_FILE = 'KVSTORE_TOKEN_FILE';
const CODE_NAMES = Object.fromEntries(Object.entries(grpc.status).map(([k, v]) => [v, k]));

// uint64/fixed64 as decimal strings (a checksum needs all 64 bits; Number keeps 53), bytes as
// Buffers, enums by name, and every field present with its default.
const LOAD_OPTIONS = {
  keepCase: true, longs: String, enums: String, bytes: Buffer, defaults: true,
  includeDirs: [CONTRACT_DIR],
};
const pkg = grpc.loadPackageDefinition(
  protoLoader.loadSync('kvstore/v1/kvstore.proto', LOAD_OPTIONS)).kvstore.v1;

const rpcRoot = new protobuf.Root();
rpcRoot.resolvePath = (origin, target) => (
  target.startsWith('google/protobuf/') ? target : path.join(RPC_DIR, target));
rpcRoot.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto']);
const RpcStatus = rpcRoot.lookupType('google.rpc.Status');
const ErrorInfo = rpcRoot.lookupType('google.rpc.ErrorInfo');

// "host" -> "host:50051", "[::1]" or "::1" -> "[::1]:50051"; a port or a unix: target unchanged.
function withDefaultPort(target) {
  if (typeof target !== 'string' || !target.trim()) {
    throw new KVStoreError(grpc.status.INVALID_ARGUMENT,
      `target must be a daemon address such as host:${DEFAULT_PORT}, got ${JSON.stringify(target)}`);
  }
  const t = target.trim();
  if (/^(unix|unix-abstract|vsock):/i.test(t) || t.includes('://')) return t;
  let port;
  if (t.startsWith('[')) {
    const end = t.indexOf(']');
    if (end < 0) throw new KVStoreError(grpc.status.INVALID_ARGUMENT, `target ${t}: '[' without ']'`);
    if (end === t.length - 1) return `${t}:${DEFAULT_PORT}`;
    port = t.slice(end + 2);
  } else if ((t.match(/:/g) || []).length > 1) {
    return `[${t}]:${DEFAULT_PORT}`;  // a bare IPv6 address has no port
  } else if (!t.includes(':')) {
    return `${t}:${DEFAULT_PORT}`;
  } else {
    port = t.slice(t.indexOf(':') + 1);
  }
  if (!/^\d+$/.test(port) || Number(port) < 1 || Number(port) > 65535) {
    throw new KVStoreError(grpc.status.INVALID_ARGUMENT,
      `target ${t}: port ${JSON.stringify(port)} is not a number from 1 to 65535`);
  }
  return t;
}

// A token is printable ASCII without whitespace (it travels in an HTTP/2 header); surrounding
// whitespace, such as a file's final newline, is dropped. `field` says where it came from.
function checkToken(token, field) {
  if (typeof token !== 'string') {
    throw new KVStoreError(grpc.status.INVALID_ARGUMENT,
      `${field} must be a string, got ${typeof token}`);
  }
  const t = token.trim();
  if (!t) throw new KVStoreError(grpc.status.INVALID_ARGUMENT, `${field}: the token is empty`);
  if (!/^[\x21-\x7e]+$/.test(t)) {
    throw new KVStoreError(grpc.status.INVALID_ARGUMENT,
      `${field}: a token is printable ASCII with no whitespace inside`);
  }
  return t;
}

// The token in a file (a Kubernetes Secret mounted as a file, say), checked as above.
function readTokenFile(file, field = ENV_TOKEN_FILE) {
  let text;
  try {
    text = fs.readFileSync(file, 'ascii');
  } catch (e) {
    throw new KVStoreError(grpc.status.INVALID_ARGUMENT,
      `${field}: cannot read token file ${JSON.stringify(file)}: ${e.message}`);
  }
  return checkToken(text, `${field} (${file})`);
}

// The token to send: `token` when given, else $KVSTORE_TOKEN, else the contents of the file
// $KVSTORE_TOKEN_FILE names; null when none is set (a daemon with auth off needs none).
function resolveToken(token = null, env = process.env) {
  if (token !== null && token !== undefined) return checkToken(token, 'token');
  if (env[ENV_TOKEN]) return checkToken(env[ENV_TOKEN], `token (from ${ENV_TOKEN})`);
  if (env[ENV_TOKEN_FILE]) {
    return readTokenFile(env[ENV_TOKEN_FILE], `token (from ${ENV_TOKEN_FILE})`);
  }
  return null;
}

// A failed call: the gRPC code, and the ErrorInfo's reason and metadata (reason is '' when the
// daemon attached none). Branch on `reason`; an unknown reason is handled by its `code`.
class KVStoreError extends Error {
  constructor(code, message, info = null) {
    super(message);
    this.name = 'KVStoreError';
    this.code = code;
    this.codeName = CODE_NAMES[code] || `code ${code}`;
    this.reason = info ? info.reason : '';
    this.domain = info ? info.domain : '';
    this.metadata = info ? { ...info.metadata } : {};
    this.hasDetails = info !== null;
  }
}

// The ErrorInfo of a failed call: grpc-status-details-bin is a serialized google.rpc.Status
// whose `details` are Any messages; the one of type google.rpc.ErrorInfo names the reason.
function errorInfoOf(metadata) {
  const values = metadata ? metadata.get(DETAILS_TRAILER) : [];
  for (const raw of values) {
    const status = RpcStatus.decode(Buffer.isBuffer(raw) ? raw : Buffer.from(raw, 'base64'));
    for (const any of status.details) {
      if (any.type_url === ERROR_INFO_TYPE || any.typeUrl === ERROR_INFO_TYPE) {
        return ErrorInfo.toObject(ErrorInfo.decode(any.value), { defaults: true });
      }
    }
  }
  return null;
}

function toKVStoreError(err) {
  if (err instanceof KVStoreError) return err;
  return new KVStoreError(err.code, err.details || err.message, errorInfoOf(err.metadata));
}

// The xxh3-64 (seed 0) of bytes as the unsigned 64-bit integer a fixed64 field carries.
async function xxh3(bytes) {
  return BigInt(`0x${await xxhash3(bytes, 0, 0)}`);
}

class KVStoreClient {
  // Dial `target`, ask Limits on a small default channel, then open the channel the calls use,
  // its send and receive limits set to the daemon's max_message_bytes. `token` (else
  // KVSTORE_TOKEN, else KVSTORE_TOKEN_FILE) goes with every call, Limits included. The
  // channel is plaintext, so the token crosses the network in the clear: use it on the
  // daemon's own node (loopback) or inside a mesh that encrypts.
  static async connect(target, { timeoutMs = 30000, token = null } = {}) {
    const address = withDefaultPort(target);
    const metadata = bearerMetadata(resolveToken(token));
    const probe = new pkg.KVStore(address, grpc.credentials.createInsecure());
    try {
      const limits = await unary(probe, 'Limits', {}, timeoutMs, { waitForReady: true },
        metadata.clone());
      return new KVStoreClient(address, limits, timeoutMs, metadata);
    } finally {
      probe.close();
    }
  }

  constructor(address, limits, timeoutMs, metadata = new grpc.Metadata()) {
    this.address = address;
    this.limits = limits;
    this.timeoutMs = timeoutMs;
    this.metadata = metadata;  // the token's header, or empty; cloned for each call
    this.maxMessageBytes = Number(limits.max_message_bytes);
    this.chunkBytes = Number(limits.chunk_bytes);
    this.stub = new pkg.KVStore(address, grpc.credentials.createInsecure(), {
      'grpc.max_receive_message_length': this.maxMessageBytes,
      'grpc.max_send_message_length': this.maxMessageBytes,
    });
    this.segments = new Map();  // shm_name -> open file descriptor
  }

  close() {
    for (const fd of this.segments.values()) fs.closeSync(fd);
    this.segments.clear();
    this.stub.close();
  }

  // Put framing: the first message is the header alone (namespace, keys, sizes, parent_key,
  // independent); every later message carries only `data`, at most chunk_bytes of the
  // payloads concatenated in key order. (The header may also carry data, as long as the
  // whole message stays under max_message_bytes; sending it alone avoids that sum.)
  put(namespace, keys, payloads, { parentKey = Buffer.alloc(0), independent = false } = {}) {
    if (keys.length !== payloads.length) {
      throw new KVStoreError(grpc.status.INVALID_ARGUMENT,
        `keys has ${keys.length} entries but payloads ${payloads.length}; one payload per key`);
    }
    return new Promise((resolve, reject) => {
      const call = this.stub.Put(this.callMetadata(), this.callOptions(), (err, reply) => (
        err ? reject(toKVStoreError(err)) : resolve(reply)));
      const header = {
        namespace, keys, sizes: payloads.map((p) => p.length), parent_key: parentKey, independent,
      };
      writeAll(call, header, payloads, this.chunkBytes).then(() => call.end(), (e) => {
        call.cancel();
        reject(e);
      });
    });
  }

  lookup(namespace, keys, blockTokens = 0) {
    return this.unary('Lookup', { namespace, keys, block_tokens: blockTokens });
  }

  // INLINE Get: the first message has found/sizes/checksums, the following ones `data` chunks
  // of the found payloads concatenated in key order. Returns one Buffer (or null) per key.
  async getInline(namespace, keys) {
    const messages = await stream(this.stub.Get({ namespace, keys, mode: 'GET_MODE_INLINE' },
      this.callMetadata(), this.callOptions()));
    const [head, ...rest] = messages;
    if (!head) throw new Error('Get ended without its first message (found, sizes, checksums)');
    const data = Buffer.concat(rest.map((m) => m.data));
    const sizes = head.sizes.map(Number);
    if (data.length !== sizes.reduce((a, b) => a + b, 0)) {
      throw new Error(`Get sent ${data.length} data bytes but its sizes add up to ` +
        `${sizes.reduce((a, b) => a + b, 0)}`);
    }
    const blocks = [];
    for (let offset = 0, i = 0; i < sizes.length; offset += sizes[i], i += 1) {
      blocks.push(data.subarray(offset, offset + sizes[i]));
    }
    return { found: head.found, ...await verified(head, blocks) };
  }

  // SHARED_MEMORY Get: one message with a lease id and, per found key, the extents of its bytes
  // in the daemon's segment (auth off: the file /dev/shm/<shm_name>). The bytes stay put until
  // Release(lease_id) or the lease expires, so copy them out, then release.
  async getShared(namespace, keys, { leaseTimeoutMs = 0 } = {}) {
    const [head] = await stream(this.stub.Get(
      { namespace, keys, mode: 'GET_MODE_SHARED_MEMORY', lease_timeout_ms: leaseTimeoutMs },
      this.callMetadata(), this.callOptions()));
    if (!head) throw new Error('Get ended without its first message (lease, locations)');
    if (!head.shm_name) {
      throw new Error(`the daemon named no shm segment (arena ${JSON.stringify(head.arena)}): ` +
        'with auth on the arenas come through Attach on its Unix socket, which this example skips');
    }
    const fd = this.segment(head.shm_name);
    const blocks = head.locations.map((location) => Buffer.concat(location.extents.map((e) => {
      const chunk = Buffer.alloc(Number(e.length));
      const read = fs.readSync(fd, chunk, 0, chunk.length, Number(e.offset));
      if (read !== chunk.length) {
        throw new Error(`extent at ${e.offset} of ${e.length} bytes: read only ${read}`);
      }
      return chunk;
    })));
    return {
      found: head.found, leaseId: head.lease_id,
      leaseExpiresInMs: Number(head.lease_expires_in_ms), ...await verified(head, blocks),
    };
  }

  segment(shmName) {
    if (!this.segments.has(shmName)) {
      this.segments.set(shmName, fs.openSync(path.join('/dev/shm', shmName), 'r'));
    }
    return this.segments.get(shmName);
  }

  release(ids) {
    return this.unary('Release', { ids });
  }

  // Every progress message until the stream ends (its end means the work is done).
  prefetch(namespace, keys, { targetTier = 'TIER_UNSPECIFIED', deadlineMs = 0 } = {}) {
    return stream(this.stub.Prefetch(
      { namespace, keys, target_tier: targetTier, deadline_ms: deadlineMs },
      this.callMetadata(), this.callOptions()));
  }

  evict(request) {
    return this.unary('Evict', request);
  }

  stats(namespace = '') {
    return this.unary('Stats', { namespace });
  }

  unary(method, request) {
    return unary(this.stub, method, request, this.timeoutMs, {}, this.callMetadata());
  }

  // grpc-js may add to a call's Metadata, so each call gets its own copy.
  callMetadata() {
    return this.metadata.clone();
  }

  callOptions() {
    return { deadline: Date.now() + this.timeoutMs };
  }
}

// `authorization: Bearer <token>`, the header auth.mode=token reads; empty without a token.
function bearerMetadata(token) {
  const metadata = new grpc.Metadata();
  if (token !== null) metadata.set('authorization', `Bearer ${token}`);
  return metadata;
}

// Each found block checked against the xxh3-64 the daemon sent with it.
async function verified(head, blocks) {
  const checksums = head.checksums.map((c) => BigInt(c));
  const mismatched = [];
  for (let i = 0; i < blocks.length; i += 1) {
    if (await xxh3(blocks[i]) !== checksums[i]) mismatched.push(i);
  }
  return { blocks, checksums, mismatched };
}

async function writeAll(call, header, payloads, chunkBytes) {
  await write(call, header);
  for (const payload of payloads) {
    for (let offset = 0; offset < payload.length; offset += chunkBytes) {
      await write(call, { data: payload.subarray(offset, offset + chunkBytes) });
    }
  }
}

// Write one message, waiting for 'drain' when the stream's buffer is full (back-pressure).
function write(call, message) {
  return new Promise((resolve) => {
    if (call.write(message)) resolve();
    else call.once('drain', resolve);
  });
}

function unary(stub, method, request, timeoutMs, extra = {}, metadata = new grpc.Metadata()) {
  return new Promise((resolve, reject) => {
    stub[method](request, metadata, { deadline: Date.now() + timeoutMs, ...extra }, (err, reply) => (
      err ? reject(toKVStoreError(err)) : resolve(reply)));
  });
}

function stream(call) {
  return new Promise((resolve, reject) => {
    const messages = [];
    call.on('data', (m) => messages.push(m));
    call.on('error', (err) => reject(toKVStoreError(err)));
    call.on('end', () => resolve(messages));
  });
}

module.exports = {
  KVStoreClient, KVStoreError, ERROR_DOMAIN, ENV_TOKEN, ENV_TOKEN_FILE, errorInfoOf, readTokenFile,
  resolveToken, withDefaultPort, xxh3, grpc,
};
