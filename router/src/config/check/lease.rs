//! The `lease` section: the backend, its path or etcd endpoints and key, the timing,
//! etcd's TLS and authentication, and the Kubernetes Lease (`lease.kubernetes`).

use std::path::PathBuf;

use serde_json::Value;

use super::{Checker, Obj, non_negative, positive};
use crate::config::{
    ConfigIssue, EtcdAccess, EtcdAuth, EtcdTls, KubernetesAccess, LeaseBackend, LeaseSection,
    SelfDrainSection, etcd_endpoint_rule, kube_api_server_rule, kube_name_rule,
};

impl Checker<'_> {
    pub(super) fn lease(&mut self, v: Option<&Value>) -> LeaseSection {
        let o = self.obj(
            "lease",
            v,
            &[
                "backend",
                "path",
                "endpoints",
                "key",
                "ttl_s",
                "renew_interval_s",
                "safety_margin_s",
                "tls",
                "auth",
                "kubernetes",
            ],
        );
        let backend = match self.choice(
            &o,
            "backend",
            "none",
            &["none", "file", "etcd", "kubernetes"],
        ) {
            "file" => LeaseBackend::File,
            "etcd" => LeaseBackend::Etcd,
            "kubernetes" => LeaseBackend::Kubernetes,
            _ => LeaseBackend::None,
        };
        let path = self.string(&o, "path", "");
        let mut endpoints = Vec::new();
        if let Some(ev) = o.get("endpoints") {
            match ev.as_array() {
                Some(a) => {
                    for (i, e) in a.iter().enumerate() {
                        match e.as_str() {
                            Some(s) if !s.is_empty() => endpoints.push(s.to_string()),
                            _ => self.ty(format!("lease.endpoints[{i}]"), e, "a non-empty string"),
                        }
                    }
                }
                None => self.ty("lease.endpoints".into(), ev, "an array of strings"),
            }
        }
        let etcd = self.etcd_access(&o, backend);
        let kubernetes = self.kubernetes_access(&o, backend);
        if backend == LeaseBackend::Etcd {
            for (i, e) in endpoints.iter().enumerate() {
                if let Some(rule) = etcd_endpoint_rule(e, etcd.tls.is_some()) {
                    self.rule(
                        format!("lease.endpoints[{i}]"),
                        &Value::from(e.as_str()),
                        rule,
                    );
                }
            }
        }
        let l = LeaseSection {
            backend,
            path,
            endpoints,
            key: self.string(&o, "key", "/narwhal/router-lease"),
            ttl_s: self.num(&o, "ttl_s", 5.0, positive),
            renew_interval_s: self.num(&o, "renew_interval_s", 1.0, positive),
            safety_margin_s: self.num(&o, "safety_margin_s", 1.0, non_negative),
            etcd,
            kubernetes,
        };
        if backend == LeaseBackend::File && l.path.is_empty() {
            self.issues.push(ConfigIssue::Missing {
                path: "lease.path".into(),
            });
        }
        if backend == LeaseBackend::Etcd && l.endpoints.is_empty() {
            self.issues.push(ConfigIssue::Missing {
                path: "lease.endpoints".into(),
            });
        }
        let min = l.renew_interval_s + l.safety_margin_s;
        if o.map.is_some() && l.ttl_s <= min {
            self.rule(
                "lease.ttl_s".into(),
                &Value::from(l.ttl_s),
                format!("must exceed renew_interval_s + safety_margin_s ({min})"),
            );
        }
        l
    }

    /// `lease.kubernetes` (docs/ha.md, "`kubernetes` backend"): object names checked as the
    /// API server would, paths non-empty; what is left out is resolved at startup.
    pub(super) fn kubernetes_access(
        &mut self,
        lease: &Obj<'_>,
        backend: LeaseBackend,
    ) -> KubernetesAccess {
        if lease.get("kubernetes").is_some() && backend != LeaseBackend::Kubernetes {
            self.issues.push(ConfigIssue::Rule {
                path: lease.p("kubernetes"),
                value: "{…}".into(),
                rule: "only used by lease.backend = \"kubernetes\"".into(),
            });
        }
        let k = self.obj(
            "lease.kubernetes",
            lease.get("kubernetes"),
            &["name", "namespace", "api_server", "token_file", "ca_file"],
        );
        let mut out = KubernetesAccess::default();
        let name = |c: &mut Self, key: &str| -> Option<String> {
            let v = k.get(key)?;
            match v.as_str() {
                Some(s) => {
                    if let Some(rule) = kube_name_rule(s) {
                        c.rule(k.p(key), v, rule);
                    }
                    Some(s.to_string())
                }
                None => {
                    c.ty(k.p(key), v, "a string");
                    None
                }
            }
        };
        if let Some(n) = name(self, "name") {
            out.name = n;
        }
        out.namespace = name(self, "namespace");
        (out.api_server, out.token_file, out.ca_file) = self.kube_api_keys(&k);
        out
    }

    /// The Kubernetes API access keys of `o` (`lease.kubernetes`, `control.self_drain`):
    /// `api_server` (`https://HOST:PORT`), `token_file` and `ca_file` (non-empty paths); what
    /// is left out is resolved at startup as a pod's.
    fn kube_api_keys(&mut self, o: &Obj<'_>) -> (Option<String>, Option<PathBuf>, Option<PathBuf>) {
        let mut api_server = None;
        if let Some(v) = o.get("api_server") {
            match v.as_str() {
                Some(s) => {
                    if let Some(rule) = kube_api_server_rule(s) {
                        self.rule(o.p("api_server"), v, rule);
                    }
                    api_server = Some(s.to_string());
                }
                None => self.ty(o.p("api_server"), v, "a string"),
            }
        }
        let mut path = |key: &str| match o.get(key) {
            Some(Value::String(s)) if !s.is_empty() => Some(PathBuf::from(s)),
            Some(v) => {
                self.ty(o.p(key), v, "a non-empty path string");
                None
            }
            None => None,
        };
        (api_server, path("token_file"), path("ca_file"))
    }

    /// `control.self_drain` (docs/kubernetes.md, "Self-drain").
    pub(super) fn self_drain(&mut self, v: Option<&Value>) -> Option<SelfDrainSection> {
        let o = self.obj(
            "control.self_drain",
            v,
            &[
                "listen",
                "audience",
                "deadline_s",
                "readmit",
                "api_server",
                "token_file",
                "ca_file",
            ],
        );
        o.map?;
        let listen = match o.get("listen") {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            Some(v) => {
                self.ty(o.p("listen"), v, "a non-empty address string (HOST:PORT)");
                String::new()
            }
            None => {
                self.issues.push(ConfigIssue::Missing {
                    path: o.p("listen"),
                });
                String::new()
            }
        };
        let audience = self.string(&o, "audience", "narwhal-self-drain");
        if audience.is_empty() {
            self.rule(o.p("audience"), &Value::from(""), "must not be empty");
        }
        let deadline_s = self.num(&o, "deadline_s", 300.0, |x| {
            (!(1.0..=crate::config::MAX_DRAIN_DEADLINE_S).contains(&x))
                .then_some("must be at least 1 s and at most a year (a drain's deadline)")
        });
        let readmit = self.boolean(&o, "readmit", true);
        let (api_server, token_file, ca_file) = self.kube_api_keys(&o);
        Some(SelfDrainSection {
            listen,
            audience,
            deadline_s,
            readmit,
            api_server,
            token_file,
            ca_file,
        })
    }

    /// `lease.tls` and `lease.auth` (docs/ha.md, "etcd TLS and authentication").
    pub(super) fn etcd_access(&mut self, lease: &Obj<'_>, backend: LeaseBackend) -> EtcdAccess {
        for k in ["tls", "auth"] {
            if lease.get(k).is_some() && backend != LeaseBackend::Etcd {
                self.issues.push(ConfigIssue::Rule {
                    path: lease.p(k),
                    // `auth` may hold a misplaced password: never echoed.
                    value: "{…}".into(),
                    rule: "only used by lease.backend = \"etcd\"".into(),
                });
            }
        }
        let path = |c: &mut Self, o: &Obj<'_>, k: &str, required: bool| match o.get(k) {
            Some(Value::String(s)) if !s.is_empty() => Some(PathBuf::from(s)),
            Some(v) => {
                c.ty(o.p(k), v, "a non-empty path string");
                None
            }
            None => {
                if required {
                    c.issues.push(ConfigIssue::Missing { path: o.p(k) });
                }
                None
            }
        };
        let t = self.obj("lease.tls", lease.get("tls"), &["ca", "cert", "key"]);
        let tls = t.map.map(|_| {
            let ca = path(self, &t, "ca", false);
            let cert = path(self, &t, "cert", false);
            let key = path(self, &t, "key", false);
            match (&cert, &key) {
                (Some(_), None) if t.get("key").is_none() => {
                    self.issues.push(ConfigIssue::Rule {
                        path: t.p("key"),
                        value: "(absent)".into(),
                        rule: "required with lease.tls.cert (the client certificate's key)".into(),
                    });
                }
                (None, Some(_)) if t.get("cert").is_none() => {
                    self.issues.push(ConfigIssue::Rule {
                        path: t.p("cert"),
                        value: "(absent)".into(),
                        rule: "required with lease.tls.key (the client certificate)".into(),
                    });
                }
                _ => {}
            }
            EtcdTls { ca, cert, key }
        });
        let a = self.obj(
            "lease.auth",
            lease.get("auth"),
            &["user", "password_file", "password"],
        );
        if a.get("password").is_some() {
            // Never echo the value: it is a secret.
            self.issues.push(ConfigIssue::Rule {
                path: a.p("password"),
                value: "(not shown)".into(),
                rule: "a password is never written in the fleet file: put it in a file only \
                       the router can read and name that file in lease.auth.password_file"
                    .into(),
            });
        }
        let auth = a.map.map(|_| {
            let user = match a.get("user") {
                Some(Value::String(s)) if !s.is_empty() => s.clone(),
                Some(v) => {
                    self.ty(a.p("user"), v, "a non-empty string");
                    String::new()
                }
                None => {
                    self.issues.push(ConfigIssue::Missing { path: a.p("user") });
                    String::new()
                }
            };
            let password_file = path(self, &a, "password_file", true).unwrap_or_default();
            EtcdAuth {
                user,
                password_file,
            }
        });
        EtcdAccess { tls, auth }
    }
}
