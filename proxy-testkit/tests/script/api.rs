//! The fake Kubernetes API server of a socket scenario's `lab ... api`: the agent runs with
//! `--kubeconfig` to a [`FakeApiServer`] (a list/watch server that behaves like
//! kube-apiserver: resourceVersions, chunked watch streams, bookmarks, 410 Gone, outages)
//! instead of `--manifests`, and the `api ...` steps change its objects and its behaviour.
//! The commands are described in `tests/scenarios/README.md`.

use std::path::{Path, PathBuf};

use k8s_openapi::api::{
    core::v1::{Namespace, Node, Pod, Service},
    discovery::v1::EndpointSlice,
};
use proxy_testkit::fakeapi::{FakeApiServer, Verb};
use serde::Deserialize;
use serde_json::Value;

use super::query::Vars;
use super::{Script, Step, duration};

/// A fake API server on a runtime of its own, and the kubeconfig that points at it.
pub struct Api {
    // Dropped before the runtime it serves on.
    server: FakeApiServer,
    rt: tokio::runtime::Runtime,
    pub kubeconfig: PathBuf,
}

impl Api {
    /// Starts a plain-HTTP server on a free port of 127.0.0.1 and writes its kubeconfig to
    /// `dir/kubeconfig`.
    pub fn start(dir: &Path) -> Api {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("tokio runtime");
        let server = rt
            .block_on(FakeApiServer::start("127.0.0.1:0".parse().unwrap()))
            .expect("fake API server");
        let kubeconfig = dir.join("kubeconfig");
        server
            .write_kubeconfig(&kubeconfig)
            .expect("writing the kubeconfig");
        Api {
            server,
            rt,
            kubeconfig,
        }
    }

    /// The agent's source arguments: `--kubeconfig FILE`.
    pub fn source(&self) -> Vec<String> {
        vec!["--kubeconfig".into(), self.kubeconfig.display().to_string()]
    }

    /// `api apply FILE... | api delete KIND [NS/]NAME | api outage start|stop |
    /// api compact | api close-watches | api failing on|off | api delay DURATION |
    /// api requests`; the last returns the request log, for `select json`.
    pub fn step(&mut self, script: &Script, step: &Step, vars: &Vars) -> Option<Value> {
        step.only(&[]);
        let w = &step.words;
        match w.get(1).map(String::as_str) {
            Some("apply") => {
                assert!(w.len() > 2, "usage: api apply FILE...");
                for f in &w[2..] {
                    let text = vars.expand(&script.file(&vars.expand(f)));
                    self.apply(f, &text);
                }
            }
            Some("delete") => {
                let kind = step.word(2, "a kind (Service, EndpointSlice, Node, Pod, Namespace)");
                let name = step.word(3, "NS/NAME (NAME for a Node or Namespace)");
                let (ns, name) = name.split_once('/').unwrap_or(("", name));
                let s = &self.server;
                let found = match kind {
                    "Service" => s.delete::<Service>(ns, name).is_some(),
                    "EndpointSlice" => s.delete::<EndpointSlice>(ns, name).is_some(),
                    "Node" => s.delete::<Node>(ns, name).is_some(),
                    "Pod" => s.delete::<Pod>(ns, name).is_some(),
                    "Namespace" => s.delete::<Namespace>(ns, name).is_some(),
                    k => panic!(
                        "api delete: no kind {k:?} (Service, EndpointSlice, Node, Pod, Namespace)"
                    ),
                };
                assert!(found, "api delete: no {kind} {ns}/{name} on the server");
            }
            Some("outage") => match w.get(2).map(String::as_str) {
                Some("start") => self.rt.block_on(self.server.stop()),
                Some("stop") => self
                    .rt
                    .block_on(self.server.restart())
                    .expect("fake API server back on its port"),
                _ => panic!("usage: api outage start|stop"),
            },
            Some("compact") => self.server.compact(),
            Some("close-watches") => self.server.close_watches(),
            Some("failing") => match w.get(2).map(String::as_str) {
                Some("on") => self.server.set_failing(true),
                Some("off") => self.server.set_failing(false),
                _ => panic!("usage: api failing on|off"),
            },
            Some("delay") => self.server.set_delay(duration(step.word(2, "a duration"))),
            Some("requests") => return Some(self.requests()),
            _ => panic!(
                "usage: api apply FILE... | api delete KIND NS/NAME | api outage start|stop | \
                 api compact | api close-watches | api failing on|off | api delay DURATION | \
                 api requests"
            ),
        }
        None
    }

    /// Applies every object of `text` (YAML, documents separated by `---`), each parsed
    /// into its k8s-openapi type by its `kind`.
    fn apply(&self, file: &str, text: &str) {
        let mut n = 0;
        for doc in serde_yaml_ng::Deserializer::from_str(text) {
            let v = Value::deserialize(doc).unwrap_or_else(|e| panic!("{file}: {e}"));
            if v.is_null() {
                continue;
            }
            fn typed<K: serde::de::DeserializeOwned>(file: &str, v: Value) -> K {
                serde_json::from_value(v).unwrap_or_else(|e| panic!("{file}: {e}"))
            }
            let s = &self.server;
            match v["kind"].as_str() {
                Some("Service") => {
                    s.apply(&typed::<Service>(file, v));
                }
                Some("EndpointSlice") => {
                    s.apply(&typed::<EndpointSlice>(file, v));
                }
                Some("Node") => {
                    s.apply(&typed::<Node>(file, v));
                }
                Some("Pod") => {
                    s.apply(&typed::<Pod>(file, v));
                }
                Some("Namespace") => {
                    s.apply(&typed::<Namespace>(file, v));
                }
                k => panic!(
                    "{file}: kind {k:?}: the API server serves Service, EndpointSlice, Node, Pod \
                     and Namespace"
                ),
            }
            n += 1;
        }
        assert!(n > 0, "{file}: no object");
    }

    /// The requests the server received (the last 10000), oldest first, one row each:
    /// `path`, `verb` (`list`, `watch`, `get`) and `params` (the query, decoded).
    fn requests(&self) -> Value {
        self.server
            .request_log()
            .iter()
            .map(|r| {
                let params: serde_json::Map<String, Value> =
                    form_urlencoded::parse(r.query.as_bytes())
                        .map(|(k, v)| (k.into_owned(), Value::from(v.into_owned())))
                        .collect();
                serde_json::json!({
                    "path": r.path,
                    "verb": match r.verb {
                        Verb::List => "list",
                        Verb::Watch => "watch",
                        Verb::Get => "get",
                    },
                    "params": params,
                })
            })
            .collect()
    }
}
