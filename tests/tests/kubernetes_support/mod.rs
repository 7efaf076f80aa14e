//! The Kubernetes provider's end-to-end harness: a real `standby-server
//! --provider kubernetes` against the tests' fake API server
//! (`standby_e2e::kube_fake`), or against a real cluster when
//! `STANDBY_TEST_KUBECONFIG` names one (the `#[ignore]`d tests; see
//! [`Server::start_real`]).

#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::ops::Deref;
use std::path::PathBuf;

use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::Api;
use nix::sys::signal::Signal;
use standby_e2e::harness::{standby_bin, write_json};
use standby_e2e::kube_fake::{Call, FakeCluster, FakeOptions};
use standby_e2e::provider_runs::{QUICK, counting_spec};
pub use standby_e2e::provider_runs::{WAIT, sandbox_of};
use standby_e2e::server_process::{ServerBuilder, ServerProcess, free_fixed_port};

pub const NAMESPACE: &str = "standby";
pub const IMAGE: &str = "standby-sandbox:fake";
pub const AGENT_PATH: &str = "/usr/local/bin/standby";

/// The operator's template: the image, a label of theirs, their own
/// non-secret variable.
pub const TEMPLATE: &str = "metadata:\n  labels: {team: e2e}\nspec:\n  containers:\n    - name: sandbox\n      image: standby-sandbox:fake\n      env: [{name: TEAM_NOTE, value: from-the-template}]\n";

pub fn fake_options() -> FakeOptions {
    FakeOptions {
        namespace: NAMESPACE.to_owned(),
        images: HashMap::from([(IMAGE.to_owned(), vec![AGENT_PATH.to_owned()])]),
        binaries: HashMap::from([(AGENT_PATH.to_owned(), standby_bin())]),
        history: 1000,
    }
}

/// A server on the Kubernetes provider, with its fake cluster.
pub struct Server {
    pub process: Option<ServerProcess>,
    pub builder: ServerBuilder,
    pub cluster: Cluster,
    pub instance: String,
    pub namespace: String,
    pub dir: tempfile::TempDir,
}

/// Where the sandboxes are: the fake, or a real cluster.
pub enum Cluster {
    Fake(FakeCluster),
    /// A real cluster's kubeconfig (`STANDBY_TEST_KUBECONFIG`).
    Real(PathBuf),
}

impl Cluster {
    pub async fn client(&self) -> kube::Client {
        match self {
            Self::Fake(fake) => fake.client().await,
            Self::Real(kubeconfig) => {
                let config = kube::config::Kubeconfig::read_from(kubeconfig).expect("read the kubeconfig");
                let options = kube::config::KubeConfigOptions::default();
                let config = kube::Config::from_custom_kubeconfig(config, &options).await.expect("a kube config");
                kube::Client::try_from(config).expect("a kube client")
            }
        }
    }

    /// The fake, for what only it can do (evict, expire, count calls).
    pub fn fake(&self) -> &FakeCluster {
        match self {
            Self::Fake(fake) => fake,
            Self::Real(_) => panic!("this step needs the fake cluster"),
        }
    }

    pub fn is_fake(&self) -> bool {
        matches!(self, Self::Fake(_))
    }
}

impl Deref for Server {
    type Target = ServerProcess;

    fn deref(&self) -> &ServerProcess {
        self.process.as_ref().expect("the server runs")
    }
}

/// What a real cluster's run needs, from the environment; `None` (the
/// test returns at once) when `STANDBY_TEST_KUBECONFIG` is unset.
struct RealCluster {
    kubeconfig: PathBuf,
    /// `STANDBY_TEST_KUBE_NAMESPACE` (default `standby-e2e`), made beforehand
    /// with the deployment's Role bound to the kubeconfig's user.
    namespace: String,
    /// `STANDBY_TEST_KUBE_IMAGE`: the sandbox image, pushed where the
    /// cluster pulls from.
    image: String,
    /// `STANDBY_TEST_KUBE_HOST`: this machine's address as the cluster's
    /// Pods reach it (the server listens on every address).
    host: String,
}

impl RealCluster {
    fn from_env() -> Option<Self> {
        let kubeconfig = std::env::var_os("STANDBY_TEST_KUBECONFIG")?;
        let var = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("STANDBY_TEST_KUBECONFIG needs {name}"));
        Some(Self {
            kubeconfig: PathBuf::from(kubeconfig),
            namespace: std::env::var("STANDBY_TEST_KUBE_NAMESPACE").unwrap_or_else(|_| "standby-e2e".to_owned()),
            image: var("STANDBY_TEST_KUBE_IMAGE"),
            host: var("STANDBY_TEST_KUBE_HOST"),
        })
    }
}

impl Server {
    /// A server on the fake cluster.
    pub async fn start(args: &[&str]) -> Self {
        Self::start_with(fake_options(), args).await
    }

    /// A server on a fake cluster of `options` (another binary as the
    /// image's `standby`, say).
    pub async fn start_with(options: FakeOptions, args: &[&str]) -> Self {
        let cluster = FakeCluster::start(options).await;
        Self::start_on(Cluster::Fake(cluster), NAMESPACE, TEMPLATE, "127.0.0.1", args).await
    }

    /// A server on the real cluster `STANDBY_TEST_KUBECONFIG` names; `None`
    /// when it names none.
    pub async fn start_real(args: &[&str]) -> Option<Self> {
        let real = RealCluster::from_env()?;
        let template = TEMPLATE.replace(IMAGE, &real.image);
        let cluster = Cluster::Real(real.kubeconfig.clone());
        Some(Self::start_on(cluster, &real.namespace, &template, &real.host, args).await)
    }

    async fn start_on(cluster: Cluster, namespace: &str, template_text: &str, host: &str, args: &[&str]) -> Self {
        let dir = tempfile::Builder::new().prefix("standby-kube-e2e-").tempdir().expect("a temp dir");
        let spec_path = dir.path().join("spec.json");
        write_json(&spec_path, &counting_spec());
        let template = dir.path().join("sandbox-pod.yaml");
        std::fs::write(&template, template_text).expect("write the pod template");
        let kubeconfig = match &cluster {
            Cluster::Fake(fake) => {
                let path = dir.path().join("kubeconfig");
                fake.write_kubeconfig(&path);
                path
            }
            Cluster::Real(path) => path.clone(),
        };
        let instance = format!("e2e-{}", dir.path().file_name().and_then(|n| n.to_str()).unwrap_or("x").to_lowercase());
        let instance: String = instance.chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-').take(40).collect();
        let port = free_fixed_port();
        let loopback = host == "127.0.0.1";
        let listen = std::net::SocketAddr::from((if loopback { [127, 0, 0, 1] } else { [0, 0, 0, 0] }, port));
        let data = dir.path().join("data");
        let builder = ServerBuilder::new(&data, &dir.path().join("server.log"), &instance)
            .listen(listen)
            .env("KUBECONFIG", &kubeconfig.display().to_string())
            .args(&[
                "--provider",
                "kubernetes",
                "--public-url",
                &format!("http://{host}:{port}"),
                "--kubernetes-namespace",
                namespace,
                "--kubernetes-pod-template",
                &template.display().to_string(),
                "--kubernetes-instance",
                &instance,
                "--log",
                "debug,kube=info,hyper=info,tower=info",
                "--agent-log",
                "debug",
                "--spec",
                &spec_path.display().to_string(),
            ]);
        let builder = builder.args_over_defaults(&QUICK, args);
        let process = builder.start().await;
        Self { process: Some(process), builder, cluster, instance, namespace: namespace.to_owned(), dir }
    }

    pub async fn pods_api(&self) -> Api<Pod> {
        Api::namespaced(self.cluster.client().await, &self.namespace)
    }

    pub async fn claims_api(&self) -> Api<PersistentVolumeClaim> {
        Api::namespaced(self.cluster.client().await, &self.namespace)
    }

    pub async fn until<T>(&self, what: &str, check: impl AsyncFnMut() -> Option<T>) -> T {
        self.process.as_ref().expect("the server runs").until(what, WAIT, check).await
    }

    /// The sandbox's Pod as the API has it; `None` when there is none.
    pub async fn pod(&self, sandbox_id: &str) -> Option<Pod> {
        self.pods_api().await.get_opt(&pod_name(sandbox_id)).await.expect("the fake answers")
    }

    pub async fn claim(&self, sandbox_id: &str) -> Option<PersistentVolumeClaim> {
        self.claims_api().await.get_opt(&format!("{}-workspace", pod_name(sandbox_id))).await.expect("the fake answers")
    }

    pub async fn stop(mut self) {
        if let Some(process) = self.process.take() {
            let status = process.stop(Signal::SIGTERM).await;
            assert!(status.success(), "standby-server exited {status}");
        }
    }
}

pub fn pod_name(sandbox_id: &str) -> String {
    format!("standby-{}", sandbox_id.replace('_', "-"))
}

pub fn uid(pod: &Pod) -> String {
    pod.metadata.uid.clone().expect("a uid")
}

/// The calls of a path, counted by verb and resource, for the log.
pub fn counted(calls: &[Call]) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for call in calls {
        *counts.entry(format!("{} {}", call.verb, call.resource)).or_default() += 1;
    }
    counts
}
