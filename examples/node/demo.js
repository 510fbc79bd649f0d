#!/usr/bin/env node
'use strict';
// The Node.js client against a running daemon, step by step:
//   node examples/node/demo.js --target HOST:PORT
//   KVSTORE_TOKEN=... node examples/node/demo.js --target HOST:PORT --namespace team-a/
// (auth.mode=token: the token from --token-file, --token, KVSTORE_TOKEN or KVSTORE_TOKEN_FILE,
// and a namespace prefix the token's tenant owns.) Checks the key vectors, asks Limits, then runs Put / Lookup / Get (INLINE and SHARED_MEMORY)
// / Release / Prefetch / Evict and two errors by their ErrorInfo reason. Prints one line per
// check and exits 1 if any check failed (2 for bad arguments).

const crypto = require('node:crypto');
const fs = require('node:fs');
const path = require('node:path');
const {
  KVStoreClient, KVStoreError, ERROR_DOMAIN, grpc, readTokenFile, resolveToken,
} = require('./client');
const { namespaceRoot, blockKeys } = require('./keys');

const VECTORS = path.resolve(__dirname, '..', '..', 'proto', 'kvstore', 'v1', 'key_vectors.json');
const BLOCK_TOKENS = 16;
const USAGE = 'usage: node demo.js [--target HOST[:PORT]] [--timeout-ms MS] [--namespace PREFIX]\n'
  + '                   [--token-file PATH | --token TOKEN]\n'
  + 'Without --token or --token-file the token (auth.mode=token) comes from KVSTORE_TOKEN, else\n'
  + 'from the file KVSTORE_TOKEN_FILE names; --token shows the token to anyone who lists\n'
  + 'processes, so prefer the others. PREFIX: where the demo\'s namespace starts (default\n'
  + 'node-demo/); with auth on, one the token\'s tenant owns.';
let failures = 0;

function check(name, ok, detail = '') {
  if (!ok) failures += 1;
  console.log(`${ok ? 'ok  ' : 'FAIL'} ${name}${detail ? `: ${detail}` : ''}`);
  return ok;
}

function parseArgs(argv) {
  const args = {
    target: '127.0.0.1:50051', timeoutMs: 30000, namespace: 'node-demo/', token: null,
    tokenFile: null,
  };
  for (let i = 0; i < argv.length; i += 1) {
    const [flag, inline] = argv[i].split(/=(.*)/s);
    const value = () => (inline !== undefined ? inline : argv[++i]);
    if (flag === '--target') args.target = value();
    else if (flag === '--timeout-ms') args.timeoutMs = Number(value());
    else if (flag === '--namespace') args.namespace = value();
    else if (flag === '--token') args.token = value();
    else if (flag === '--token-file') args.tokenFile = value();
    else if (flag === '--help' || flag === '-h') {
      console.log(USAGE);
      process.exit(0);
    } else {
      console.error(`demo.js: unknown argument ${argv[i]} (try --help)`);
      process.exit(2);
    }
  }
  if (!args.target || !(args.timeoutMs > 0)) {
    console.error('demo.js: --target needs HOST[:PORT] and --timeout-ms a positive number');
    process.exit(2);
  }
  if (args.token !== null && args.tokenFile !== null) {
    console.error('demo.js: give --token or --token-file, not both');
    process.exit(2);
  }
  if (!args.namespace) {
    console.error('demo.js: --namespace needs a prefix such as team-a/');
    process.exit(2);
  }
  return args;
}

function checkVectors() {
  const { vectors } = JSON.parse(fs.readFileSync(VECTORS, 'utf8'));
  let matched = 0;
  for (const v of vectors) {
    const root = namespaceRoot(v.namespace).toString('hex');
    const keys = blockKeys(v.namespace, v.tokens, v.block_size).map((k) => k.toString('hex'));
    const ok = root === v.root && JSON.stringify(keys) === JSON.stringify(v.keys);
    if (ok) matched += 1;
    else check(`key vector "${v.name}"`, false, `root ${root}, keys ${keys.join(',')}`);
  }
  check('key vectors', matched === vectors.length && vectors.length > 0,
    `${matched}/${vectors.length} match`);
}

// What a client does on each reason: the point of ErrorInfo is branching on this, not on text.
function advice(err) {
  switch (err.reason) {
    case 'INVALID_FIELD': return `fix request field ${err.metadata.field || '?'}`;
    case 'LEASE_EXPIRED': return 'the lease is gone: Get again';
    case 'NO_ROOM': return 'no room even after eviction: retry later or write less';
    case 'MESSAGE_TOO_LARGE': return `split the request (limit ${err.metadata.limit || '?'})`;
    case 'ENTRY_VANISHED': return 'evicted mid-read: retry the Get';
    case 'DRAINING': return 'the daemon is stopping: use another';
    case 'UNAUTHENTICATED': return 'auth.mode=token: set KVSTORE_TOKEN (or --token-file) to a '
      + "token in the daemon's tenants file";
    case 'NOT_OWNER': return "use a --namespace prefix the token's tenant owns";
    case 'ROLE_DENIED': return 'this verb needs an admin token';
    case '': return `no ErrorInfo attached; by code ${err.codeName} alone`;
    default: return `unknown reason ${err.reason}: handle by code ${err.codeName}`;
  }
}

async function expectError(name, promise, code, reason, metadata = {}) {
  try {
    await promise;
    check(name, false, `succeeded; expected ${reason}`);
    return;
  } catch (e) {
    if (!(e instanceof KVStoreError)) throw e;
    check(`${name}: status code`, e.code === code, `${e.codeName} (${e.message})`);
    if (!e.hasDetails) {
      check(`${name}: ErrorInfo`, false,
        'the daemon sent no google.rpc.ErrorInfo in grpc-status-details-bin');
      return;
    }
    const want = Object.entries(metadata);
    const ok = e.domain === ERROR_DOMAIN && e.reason === reason
      && want.every(([k, v]) => e.metadata[k] === v);
    check(`${name}: ErrorInfo`, ok, `domain ${e.domain}, reason ${e.reason}, metadata ` +
      `${JSON.stringify(e.metadata)} -> ${advice(e)}`);
  }
}

function samePayloads(got, want) {
  return got.length === want.length && got.every((b, i) => b.equals(want[i]));
}

async function run(kv, prefix) {
  const { limits } = kv;
  check('Limits', limits.contract === 'kvstore.v1' && kv.maxMessageBytes > kv.chunkBytes,
    `contract ${limits.contract}, max_message_bytes ${limits.max_message_bytes}, chunk_bytes ` +
    `${limits.chunk_bytes}, max_object_bytes ${limits.max_object_bytes}, max_batch_keys ` +
    `${limits.max_batch_keys}, shared_memory ${limits.shared_memory}, auth ${limits.auth_mode}`);

  const namespace = `${prefix}${process.pid}-${Date.now()}`;
  const tokens = Array.from({ length: 4 * BLOCK_TOKENS }, (_, i) => (i * 7919) % 32000);
  const keys = blockKeys(namespace, tokens, BLOCK_TOKENS);
  // The first block spans two Put chunks and two Get chunks; the last is three bytes.
  const first = Math.min(kv.chunkBytes + 4097, Number(limits.max_object_bytes));
  const payloads = [first, 65536, 1000, 3].map((n) => crypto.randomBytes(n));
  const stranger = crypto.createHash('sha256').update('never stored').digest();

  const put = await kv.put(namespace, keys, payloads);
  check('Put', put.stored === keys.length, `stored ${put.stored}, existing ${put.existing}`);
  const again = await kv.put(namespace, keys, payloads);
  check('Put again (values are immutable)', again.existing === keys.length && again.stored === 0,
    `stored ${again.stored}, existing ${again.existing}`);

  const look = await kv.lookup(namespace, [...keys, stranger], BLOCK_TOKENS);
  check('Lookup', look.prefix_length === keys.length && look.tiers[keys.length] === 'TIER_UNSPECIFIED',
    `prefix_length ${look.prefix_length}, tiers ${look.tiers.join(',')}`);

  const inline = await kv.getInline(namespace, [...keys, stranger]);
  check('Get INLINE', inline.found.join() === [...keys.map(() => true), false].join()
    && samePayloads(inline.blocks, payloads) && inline.mismatched.length === 0,
  `found ${inline.found.join(',')}, ${inline.blocks.length} blocks bit-exact, xxh3 verified`);

  if (limits.shared_memory && limits.auth_mode === 'off') {
    const shared = await kv.getShared(namespace, keys);
    check('Get SHARED_MEMORY', samePayloads(shared.blocks, payloads)
      && shared.mismatched.length === 0 && shared.leaseId !== '',
    `lease ${shared.leaseId} (${shared.leaseExpiresInMs} ms), read from /dev/shm, xxh3 verified`);
    const released = await kv.release([shared.leaseId]);
    check('Release', released.released === 1, `released ${released.released}`);
    await expectError('Release of an ended lease', kv.release([shared.leaseId]),
      grpc.status.INVALID_ARGUMENT, 'LEASE_EXPIRED');
  } else {
    console.log('skip Get SHARED_MEMORY: the daemon has no L2 segment open to this client');
  }

  const progress = await kv.prefetch(namespace, [...keys, stranger]);
  const last = progress[progress.length - 1] || {};
  check('Prefetch (stream read to its end)', progress.length > 0 && last.total === keys.length + 1
    && last.done === keys.length && last.missing === 1 && last.prefix_length === keys.length,
  `${progress.length} messages, last: done ${last.done}, missing ${last.missing}, failed ` +
    `${last.failed}, total ${last.total}, prefix_length ${last.prefix_length}`);

  await expectError('Get of a 5-byte key', kv.getInline(namespace, [Buffer.from('short')]),
    grpc.status.INVALID_ARGUMENT, 'INVALID_FIELD', { field: 'keys[0]' });

  const evicted = await kv.evict({ namespace, keys });
  const after = await kv.lookup(namespace, keys);
  check('Evict', evicted.evicted >= keys.length && after.prefix_length === 0,
    `evicted ${evicted.evicted} (${evicted.evicted_bytes} bytes), prefix_length now ` +
    `${after.prefix_length}`);
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  // A bad token (empty, with spaces, an unreadable file) is a bad argument: exit 2 before
  // dialing, naming where it came from.
  let token;
  try {
    token = resolveToken(
      args.tokenFile !== null ? readTokenFile(args.tokenFile, '--token-file') : args.token);
  } catch (e) {
    console.error(`demo.js: ${e.message}`);
    process.exit(2);
  }
  checkVectors();
  let kv;
  try {
    kv = await KVStoreClient.connect(args.target, { timeoutMs: args.timeoutMs, token });
    console.log(`connected to ${kv.address}`);
    await run(kv, args.namespace);
  } catch (e) {
    check('demo', false, e instanceof KVStoreError
      ? `${e.codeName} ${e.reason || '(no reason)'}: ${e.message} -> ${advice(e)}` : e.stack);
  } finally {
    if (kv) kv.close();
  }
  console.log(failures === 0 ? 'node client: all checks passed' : `node client: ${failures} check(s) failed`);
  process.exitCode = failures === 0 ? 0 : 1;
}

main();
