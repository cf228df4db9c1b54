/**
 * A private CA and a server certificate it signed (for `localhost` and 127.0.0.1), made with
 * openssl in a temporary directory: what a coordinator behind a company's own CA presents. A
 * client that has not been told to trust `ca` fails with `unable to verify the first certificate`.
 */
import { execFile } from 'node:child_process';
import { mkdtemp, readFile, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';

const run = promisify(execFile);

export interface PrivateCa {
  dir: string;
  /** The CA's certificate (PEM file path). */
  ca: string;
  /** The server's certificate and key (PEM file paths), for `localhost` and 127.0.0.1. */
  cert: string;
  key: string;
  /** The server's certificate and key, read. */
  pem: { cert: Buffer; key: Buffer };
}

/** Makes the CA and the server certificate in a new temporary directory (the caller removes `dir`). */
export async function makePrivateCa(): Promise<PrivateCa> {
  const dir = await mkdtemp(path.join(process.env.LEASEHOLD_TEST_TMP ?? os.tmpdir(), 'leasehold-ca-'));
  const f = (name: string) => path.join(dir, name);
  const ec = ['-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:P-256', '-nodes'];
  await run('openssl', ['req', '-x509', ...ec, '-keyout', f('ca.key'), '-out', f('ca.pem'), '-days', '1', '-subj', '/CN=Leasehold test CA']);
  await run('openssl', ['req', ...ec, '-keyout', f('key.pem'), '-out', f('server.csr'), '-subj', '/CN=localhost']);
  await writeFile(f('ext'), 'subjectAltName=DNS:localhost,IP:127.0.0.1\n');
  await run('openssl', ['x509', '-req', '-in', f('server.csr'), '-CA', f('ca.pem'), '-CAkey', f('ca.key'), '-CAcreateserial', '-out', f('cert.pem'), '-days', '1', '-extfile', f('ext')]);
  return { dir, ca: f('ca.pem'), cert: f('cert.pem'), key: f('key.pem'), pem: { cert: await readFile(f('cert.pem')), key: await readFile(f('key.pem')) } };
}

/**
 * A client certificate (an agent's, for mTLS) that `ca` signed, with `extendedKeyUsage=clientAuth`,
 * its subject `CN=<name>`: PEM file paths in `ca.dir`.
 */
export async function makeClientCert(ca: PrivateCa, name: string): Promise<{ cert: string; key: string }> {
  const f = (file: string) => path.join(ca.dir, file);
  const ec = ['-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:P-256', '-nodes'];
  await run('openssl', ['req', ...ec, '-keyout', f(`${name}.key.pem`), '-out', f(`${name}.csr`), '-subj', `/CN=${name}`]);
  await writeFile(f(`${name}.ext`), 'extendedKeyUsage=clientAuth\n');
  await run('openssl', ['x509', '-req', '-in', f(`${name}.csr`), '-CA', ca.ca, '-CAkey', f('ca.key'), '-CAcreateserial', '-out', f(`${name}.cert.pem`), '-days', '1', '-extfile', f(`${name}.ext`)]);
  return { cert: f(`${name}.cert.pem`), key: f(`${name}.key.pem`) };
}
