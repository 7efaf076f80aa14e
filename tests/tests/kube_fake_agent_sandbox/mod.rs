//! The fake's agent-sandbox controllers (SandboxTemplate, SandboxWarmPool,
//! SandboxClaim, Sandbox), driven by the real `kube::Client` through
//! `DynamicObject`s, as the provider's agent-sandbox mode will drive them.

use futures::StreamExt;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::api::{
    Api, ApiResource, AttachParams, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use kube::runtime::watcher;
use serde_json::{Value, json};
use tokio::io::AsyncReadExt;

use crate::kube_fake_support::{IMAGE, cluster, gone, in_time, running};

const NS: &str = "standby";
const WARM_POOL_LABEL: &str = "agents.x-k8s.io/warm-pool-sandbox";
const TEMPLATE_REF_HASH_LABEL: &str = "agents.x-k8s.io/sandbox-template-ref-hash";
const NAME_HASH_LABEL: &str = "agents.x-k8s.io/sandbox-name-hash";

fn api(client: &kube::Client, group: &str, kind: &str, plural: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, "v1beta1", kind), plural);
    Api::namespaced_with(client.clone(), NS, &ar)
}

struct Apis {
    templates: Api<DynamicObject>,
    pools: Api<DynamicObject>,
    claims: Api<DynamicObject>,
    sandboxes: Api<DynamicObject>,
    policies: Api<DynamicObject>,
    pods: Api<Pod>,
    pvcs: Api<PersistentVolumeClaim>,
}

fn apis(client: &kube::Client) -> Apis {
    let np = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("networking.k8s.io", "v1", "NetworkPolicy"),
        "networkpolicies",
    );
    Apis {
        templates: api(client, "extensions.agents.x-k8s.io", "SandboxTemplate", "sandboxtemplates"),
        pools: api(client, "extensions.agents.x-k8s.io", "SandboxWarmPool", "sandboxwarmpools"),
        claims: api(client, "extensions.agents.x-k8s.io", "SandboxClaim", "sandboxclaims"),
        sandboxes: api(client, "agents.x-k8s.io", "Sandbox", "sandboxes"),
        policies: Api::namespaced_with(client.clone(), NS, &np),
        pods: Api::namespaced(client.clone(), NS),
        pvcs: Api::namespaced(client.clone(), NS),
    }
}

fn object(v: Value) -> DynamicObject {
    serde_json::from_value(v).expect("an object")
}

fn value(o: DynamicObject) -> Value {
    serde_json::to_value(o).expect("JSON")
}

/// A template whose pod runs `sh` until SIGTERM, with a claim template
/// `workspace` mounted at /data; `egress` as its NetworkPolicy's egress
/// rules (None: the controller's default policy).
fn template(name: &str, egress: Option<Value>) -> DynamicObject {
    let mut t = json!({
        "apiVersion": "extensions.agents.x-k8s.io/v1beta1",
        "kind": "SandboxTemplate",
        "metadata": { "name": name },
        "spec": {
            "podTemplate": {
                "metadata": { "labels": { "app": "sandbox" }, "annotations": { "note": "n" } },
                "spec": {
                    "terminationGracePeriodSeconds": 2,
                    "containers": [{
                        "name": "main",
                        "image": IMAGE,
                        "command": ["/bin/sh", "-c", "trap 'exit 0' TERM; sleep 1000 & wait"],
                        "volumeMounts": [{ "name": "workspace", "mountPath": "/data" }],
                    }],
                },
            },
            "volumeClaimTemplates": [{
                "metadata": { "name": "workspace", "labels": { "volume": "ws" } },
                "spec": { "accessModes": ["ReadWriteOnce"], "resources": { "requests": { "storage": "1Gi" } } },
            }],
        },
    });
    if let Some(egress) = egress {
        t["spec"]["networkPolicy"] = json!({ "egress": egress });
    }
    object(t)
}

fn pool(name: &str, template: &str, replicas: u32) -> DynamicObject {
    object(json!({
        "apiVersion": "extensions.agents.x-k8s.io/v1beta1",
        "kind": "SandboxWarmPool",
        "metadata": { "name": name },
        "spec": { "replicas": replicas, "sandboxTemplateRef": { "name": template } },
    }))
}

fn claim(name: &str, pool: &str) -> DynamicObject {
    object(json!({
        "apiVersion": "extensions.agents.x-k8s.io/v1beta1",
        "kind": "SandboxClaim",
        "metadata": { "name": name },
        "spec": { "warmPoolRef": { "name": pool } },
    }))
}

fn s<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

fn label<'a>(v: &'a Value, key: &str) -> &'a str {
    s(v, &format!("/metadata/labels/{}", key.replace('/', "~1")))
}

fn condition<'a>(v: &'a Value, kind: &str) -> (&'a str, &'a str) {
    let c = v
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .and_then(|cs| cs.iter().find(|c| s(c, "/type") == kind));
    c.map_or(("", ""), |c| (s(c, "/status"), s(c, "/reason")))
}

fn ready(v: &Value) -> bool {
    condition(v, "Ready").0 == "True"
}

fn controller(v: &Value) -> (&str, &str) {
    let r = v
        .pointer("/metadata/ownerReferences")
        .and_then(Value::as_array)
        .and_then(|rs| rs.iter().find(|r| r["controller"] == json!(true)));
    r.map_or(("", ""), |r| (s(r, "/kind"), s(r, "/name")))
}

/// Waits (a watch wakes each look) until `pred` holds over the objects
/// that carry `labels` (a selector; "" for all); returns them.
async fn until(api: &Api<DynamicObject>, labels: &str, what: &str, pred: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    in_time(
        what,
        Box::pin(async {
            let mut config = watcher::Config::default();
            let mut params = kube::api::ListParams::default();
            if !labels.is_empty() {
                config = config.labels(labels);
                params = params.labels(labels);
            }
            let mut events = watcher(api.clone(), config).boxed();
            loop {
                let list = api.list(&params).await.expect("a list");
                let items: Vec<Value> = list.items.into_iter().map(value).collect();
                if pred(&items) {
                    return items;
                }
                events.next().await;
            }
        }),
    )
    .await
}

/// Waits until `pred` holds of the object `name` (None: it does not exist).
async fn until_one(
    api: &Api<DynamicObject>,
    name: &str,
    what: &str,
    pred: impl Fn(Option<&Value>) -> bool,
) -> Option<Value> {
    let items = until(api, "", what, |items| pred(items.iter().find(|o| s(o, "/metadata/name") == name))).await;
    items.into_iter().find(|o| s(o, "/metadata/name") == name)
}

/// Runs `cmd` in the pod; returns its stdout.
async fn exec(pods: &Api<Pod>, pod: &str, cmd: &[&str]) -> String {
    let mut attached = pods.exec(pod, cmd.to_vec(), &AttachParams::default().stderr(false)).await.expect("exec");
    let mut stdout = attached.stdout().expect("stdout");
    let status = attached.take_status().expect("a status");
    let mut out = String::new();
    in_time("the exec's output", stdout.read_to_string(&mut out)).await.expect("read stdout");
    let status = in_time("the exec's status", status).await.expect("a status");
    assert_eq!(status.status.as_deref(), Some("Success"), "{cmd:?}: {status:?}");
    out
}

async fn unclaimed(apis: &Apis, pool: &str, n: usize) -> Vec<Value> {
    let selector = format!("{WARM_POOL_LABEL}={}", pool_hash(pool));
    until(&apis.sandboxes, &selector, &format!("{n} Ready sandboxes in the pool"), |sbs| {
        sbs.len() == n && sbs.iter().all(ready)
    })
    .await
}

/// The FNV-1a hash the real controller labels with.
fn pool_hash(name: &str) -> String {
    let mut h: u32 = 0x811c_9dc5;
    for b in name.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    format!("{h:08x}")
}

#[tokio::test]
async fn a_warm_pool_keeps_ready_sandboxes_and_a_claim_adopts_one() {
    let (cluster, client) = cluster().await;
    let apis = apis(&client);
    let pp = PostParams::default();
    let egress = json!([{
        "to": [{ "ipBlock": { "cidr": "0.0.0.0/0", "except": ["10.0.0.0/8"] } }],
        "ports": [{ "protocol": "TCP", "port": 443 }],
    }]);
    apis.templates.create(&pp, &template("tpl", Some(egress.clone()))).await.expect("the template");
    apis.pools.create(&pp, &pool("pool", "tpl", 2)).await.expect("the pool");

    let warm = unclaimed(&apis, "pool", 2).await;
    for sb in &warm {
        let name = s(sb, "/metadata/name");
        assert!(name.starts_with("pool-"), "{name}");
        assert_eq!(controller(sb), ("SandboxWarmPool", "pool"));
        assert_eq!(label(sb, TEMPLATE_REF_HASH_LABEL), pool_hash("tpl"));
        assert_eq!(label(sb, "agents.x-k8s.io/launch-type"), "warm");
        assert_eq!(s(sb, "/metadata/annotations/agents.x-k8s.io~1pod-name"), name);
        assert_eq!(sb["status"]["podIPs"], json!(["127.0.0.1"]));
        assert_eq!(s(sb, "/status/nodeName"), "fake-node");
        assert_eq!(condition(sb, "Ready"), ("True", "DependenciesReady"));
        assert_eq!(condition(sb, "Suspended"), ("False", "NotSuspended"));
        assert_eq!(sb["spec"]["podTemplate"]["spec"]["automountServiceAccountToken"], json!(false));

        let pod = value_of(apis.pods.get(name).await.expect("its pod"));
        assert_eq!(controller(&pod), ("Sandbox", name));
        assert_eq!(label(&pod, "app"), "sandbox");
        assert_eq!(label(&pod, NAME_HASH_LABEL), pool_hash(name));
        assert_eq!(label(&pod, WARM_POOL_LABEL), pool_hash("pool"));
        assert_eq!(label(&pod, TEMPLATE_REF_HASH_LABEL), pool_hash("tpl"));
        assert_eq!(s(&pod, "/metadata/annotations/note"), "n");
        let volumes = &pod["spec"]["volumes"];
        assert_eq!(
            volumes,
            &json!([{ "name": "workspace", "persistentVolumeClaim": { "claimName": format!("workspace-{name}") } }])
        );

        let pvc = value_of(apis.pvcs.get(&format!("workspace-{name}")).await.expect("its PVC"));
        assert_eq!(controller(&pvc), ("Sandbox", name));
        assert_eq!(label(&pvc, "volume"), "ws");
        assert_eq!(label(&pvc, NAME_HASH_LABEL), pool_hash(name));
    }
    let pool_status = until_one(&apis.pools, "pool", "the pool's status", |p| {
        p.is_some_and(|p| p["status"]["replicas"] == json!(2) && p["status"]["readyReplicas"] == json!(2))
    })
    .await
    .expect("the pool");
    assert_eq!(s(&pool_status, "/status/selector"), format!("{WARM_POOL_LABEL}={}", pool_hash("pool")));

    // The template's managed NetworkPolicy: its egress rules, selecting the
    // template's pods by the template-ref hash.
    let np = until_one(&apis.policies, "tpl-network-policy", "the NetworkPolicy", |np| np.is_some()).await.expect("it");
    assert_eq!(np["spec"]["egress"], egress);
    assert!(np["spec"].get("ingress").is_none(), "no ingress rule: all ingress denied");
    assert_eq!(np["spec"]["podSelector"], json!({ "matchLabels": { TEMPLATE_REF_HASH_LABEL: pool_hash("tpl") } }));
    assert_eq!(np["spec"]["policyTypes"], json!(["Ingress", "Egress"]));
    assert_eq!(controller(&np), ("SandboxTemplate", "tpl"));

    // A claim adopts a Ready one; the pool makes another.
    let created = value(apis.claims.create(&pp, &claim("c1", "pool")).await.expect("the claim"));
    let claim_uid = s(&created, "/metadata/uid").to_owned();
    let bound = until_one(&apis.claims, "c1", "the claim Ready", |c| c.is_some_and(ready)).await.expect("the claim");
    let name = s(&bound, "/status/sandbox/name").to_owned();
    assert!(warm.iter().any(|sb| s(sb, "/metadata/name") == name), "{name} was warm");
    assert_eq!(bound["status"]["sandbox"]["podIPs"], json!(["127.0.0.1"]));
    assert_eq!(condition(&bound, "Ready"), ("True", "DependenciesReady"));
    assert_eq!(s(&bound, "/metadata/annotations/agents.x-k8s.io~1sandbox-name"), name);
    let adopted = value(apis.sandboxes.get(&name).await.expect("the adopted sandbox"));
    assert_eq!(controller(&adopted), ("SandboxClaim", "c1"));
    assert_eq!(label(&adopted, "agents.x-k8s.io/claim-uid"), claim_uid);
    assert_eq!(label(&adopted, WARM_POOL_LABEL), "");
    assert_eq!(label(&adopted, TEMPLATE_REF_HASH_LABEL), pool_hash("tpl"));
    let after = unclaimed(&apis, "pool", 2).await;
    assert!(after.iter().all(|sb| s(sb, "/metadata/name") != name), "the pool no longer counts {name}");

    // Its pod keeps running, loses the warm-pool label, and takes an exec.
    let pod = apis.pods.get(&name).await.expect("the adopted pod");
    let uid = pod.metadata.uid.clone();
    until_pod(&apis.pods, &name, "the pod leaves the pool", |p| label(p, WARM_POOL_LABEL).is_empty()).await;
    assert_eq!(apis.pods.get(&name).await.expect("the pod").metadata.uid, uid, "the same pod");
    assert_eq!(exec(&apis.pods, &name, &["sh", "-c", "echo hi"]).await, "hi\n");

    // Settled, the controllers write nothing more (they are level-triggered
    // on every write, their own included: a write that differs each pass
    // would never stop). An absence cannot be awaited: a short look.
    let version =
        || async { apis.sandboxes.list(&Default::default()).await.expect("a list").metadata.resource_version };
    let before = version().await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(version().await, before, "no writes once settled");
    drop(cluster);
}

fn value_of<T: serde::Serialize>(o: T) -> Value {
    serde_json::to_value(o).expect("JSON")
}

async fn until_pod(pods: &Api<Pod>, name: &str, what: &str, pred: impl Fn(&Value) -> bool) {
    crate::kube_fake_support::until(pods, name, what, move |p: Option<&Pod>| {
        p.is_some_and(|p| pred(&serde_json::to_value(p).expect("JSON")))
    })
    .await;
}

#[tokio::test]
async fn suspend_keeps_the_volume_resume_makes_a_new_pod_and_deleting_the_claim_deletes_everything() {
    let (cluster, client) = cluster().await;
    let apis = apis(&client);
    let pp = PostParams::default();
    apis.templates.create(&pp, &template("tpl", None)).await.expect("the template");
    apis.pools.create(&pp, &pool("pool", "tpl", 1)).await.expect("the pool");
    unclaimed(&apis, "pool", 1).await;
    apis.claims.create(&pp, &claim("c1", "pool")).await.expect("the claim");
    let bound = until_one(&apis.claims, "c1", "the claim Ready", |c| c.is_some_and(ready)).await.expect("the claim");
    let name = s(&bound, "/status/sandbox/name").to_owned();
    let pvc = format!("workspace-{name}");
    // `$0` is an argument of the exec: the fake maps it to the PVC's directory.
    exec(&apis.pods, &name, &["sh", "-c", "echo kept > $0", "/data/file"]).await;
    assert_eq!(std::fs::read_to_string(cluster.pvc_dir(&pvc).join("file")).expect("the file"), "kept\n");
    let first = apis.pods.get(&name).await.expect("the pod").metadata.uid.expect("a uid");

    let suspend = Patch::Merge(json!({ "spec": { "operatingMode": "Suspended" } }));
    apis.sandboxes.patch(&name, &PatchParams::default(), &suspend).await.expect("suspend");
    gone(&apis.pods, &name, &first).await;
    let suspended = until_one(&apis.sandboxes, &name, "the sandbox suspended", |sb| {
        sb.is_some_and(|sb| condition(sb, "Suspended") == ("True", "PodTerminated"))
    })
    .await
    .expect("the sandbox");
    assert_eq!(condition(&suspended, "Ready"), ("False", "SandboxSuspended"));
    assert!(suspended["status"].get("podIPs").is_none(), "{:?}", suspended["status"]);
    assert_eq!(s(&suspended, "/metadata/annotations/agents.x-k8s.io~1pod-name"), "");
    apis.pvcs.get(&pvc).await.expect("the PVC is kept");
    let claim = until_one(&apis.claims, "c1", "the claim follows", |c| {
        c.is_some_and(|c| condition(c, "Ready") == ("False", "SandboxSuspended"))
    })
    .await
    .expect("the claim");
    assert!(claim["status"]["sandbox"].get("podIPs").is_none());

    let resume = Patch::Merge(json!({ "spec": { "operatingMode": "Running" } }));
    apis.sandboxes.patch(&name, &PatchParams::default(), &resume).await.expect("resume");
    let second = running(&apis.pods, &name).await;
    assert_ne!(second.metadata.uid.as_deref(), Some(first.as_str()), "a new pod");
    assert_eq!(exec(&apis.pods, &name, &["cat", "/data/file"]).await, "kept\n", "the same volume");
    let resumed =
        until_one(&apis.sandboxes, &name, "the sandbox Ready again", |sb| sb.is_some_and(ready)).await.expect("it");
    assert_eq!(condition(&resumed, "Suspended"), ("False", "NotSuspended"));
    until_one(&apis.claims, "c1", "the claim Ready again", |c| c.is_some_and(ready)).await;

    apis.claims.delete("c1", &DeleteParams::default()).await.expect("delete the claim");
    until_one(&apis.sandboxes, &name, "the sandbox gone", |o| o.is_none()).await;
    gone(&apis.pods, &name, second.metadata.uid.as_deref().expect("a uid")).await;
    in_time("the PVC gone", async {
        let uid = apis.pvcs.get(&pvc).await.map(|p| p.metadata.uid.unwrap_or_default()).unwrap_or_default();
        if !uid.is_empty() {
            kube::runtime::wait::await_condition(
                apis.pvcs.clone(),
                &pvc,
                kube::runtime::wait::conditions::is_deleted(&uid),
            )
            .await
            .expect("a watch");
        }
    })
    .await;
    assert!(!cluster.pvc_dir(&pvc).exists(), "its directory removed");
}

#[tokio::test]
async fn a_claim_without_a_free_warm_sandbox_gets_a_cold_one() {
    let (_cluster, client) = cluster().await;
    let apis = apis(&client);
    let pp = PostParams::default();
    apis.templates.create(&pp, &template("tpl", None)).await.expect("the template");
    apis.pools.create(&pp, &pool("pool", "tpl", 0)).await.expect("the pool");
    let created = value(apis.claims.create(&pp, &claim("cold", "pool")).await.expect("the claim"));
    let bound = until_one(&apis.claims, "cold", "the claim Ready", |c| c.is_some_and(ready)).await.expect("the claim");
    assert_eq!(s(&bound, "/status/sandbox/name"), "cold", "named as the claim");
    let sb = value(apis.sandboxes.get("cold").await.expect("the cold sandbox"));
    assert_eq!(controller(&sb), ("SandboxClaim", "cold"));
    assert_eq!(label(&sb, "agents.x-k8s.io/launch-type"), "cold");
    assert_eq!(label(&sb, "agents.x-k8s.io/claim-uid"), s(&created, "/metadata/uid"));
    assert_eq!(s(&sb, "/metadata/annotations/agents.x-k8s.io~1sandbox-template-ref"), "tpl");
    // Under the default NetworkPolicy the real controller points DNS at public resolvers.
    assert_eq!(sb["spec"]["podTemplate"]["spec"]["dnsPolicy"], json!("None"));
    running(&apis.pods, "cold").await;
    apis.pvcs.get("workspace-cold").await.expect("its PVC");

    // A claim of a pool that does not exist: a condition, nothing made.
    apis.claims.create(&pp, &claim("orphan", "nope")).await.expect("the claim");
    let orphan = until_one(&apis.claims, "orphan", "the claim's condition", |c| {
        c.is_some_and(|c| condition(c, "Ready").1 == "WarmPoolNotFound")
    })
    .await
    .expect("the claim");
    assert_eq!(condition(&orphan, "Ready").0, "False");
    assert!(apis.sandboxes.get_opt("orphan").await.expect("a get").is_none());
}

#[tokio::test]
async fn the_default_network_policy_blocks_private_ranges_and_unmanaged_has_none() {
    let (_cluster, client) = cluster().await;
    let apis = apis(&client);
    let pp = PostParams::default();
    // A pool whose template does not exist yet makes nothing.
    apis.pools.create(&pp, &pool("pool", "later", 1)).await.expect("the pool");
    let waiting = until_one(&apis.pools, "pool", "the pool's status", |p| p.is_some_and(|p| p.get("status").is_some()))
        .await
        .expect("the pool");
    assert_eq!(waiting["status"]["replicas"], json!(0));
    assert!(apis.sandboxes.list(&Default::default()).await.expect("a list").items.is_empty());

    apis.templates.create(&pp, &template("later", None)).await.expect("the template");
    let np =
        until_one(&apis.policies, "later-network-policy", "the NetworkPolicy", |np| np.is_some()).await.expect("it");
    let except = &np["spec"]["egress"][0]["to"][0]["ipBlock"];
    assert_eq!(except["cidr"], json!("0.0.0.0/0"));
    assert_eq!(except["except"], json!(["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16"]));
    assert_eq!(
        np["spec"]["ingress"][0]["from"][0]["podSelector"],
        json!({ "matchLabels": { "app": "sandbox-router" } })
    );
    until(&apis.sandboxes, "", "the pool fills once its template exists", |sbs| sbs.len() == 1).await;
    let t = value(apis.templates.get("later").await.expect("the template"));
    assert_eq!(label(&t, TEMPLATE_REF_HASH_LABEL), pool_hash("later"));

    // Unmanaged: the controller's policy is removed.
    let unmanaged = Patch::Merge(json!({ "spec": { "networkPolicyManagement": "Unmanaged" } }));
    apis.templates.patch("later", &PatchParams::default(), &unmanaged).await.expect("unmanaged");
    until_one(&apis.policies, "later-network-policy", "the NetworkPolicy removed", |o| o.is_none()).await;
}

#[tokio::test]
async fn a_claim_waits_briefly_for_warm_sandboxes_without_an_ip_then_starts_cold() {
    let (_cluster, client) = cluster().await;
    let apis = apis(&client);
    let pp = PostParams::default();
    // Its pods wait for a PVC that never comes: no IP, never Ready.
    let mut stuck = value(template("tpl", None));
    stuck["spec"]["podTemplate"]["spec"]["volumes"] =
        json!([{ "name": "missing", "persistentVolumeClaim": { "claimName": "nope" } }]);
    apis.templates.create(&pp, &object(stuck)).await.expect("the template");
    apis.pools.create(&pp, &pool("pool", "tpl", 1)).await.expect("the pool");
    let selector = format!("{WARM_POOL_LABEL}={}", pool_hash("pool"));
    let warm = until(&apis.sandboxes, &selector, "a pool member", |sbs| sbs.len() == 1).await;
    let warm = s(&warm[0], "/metadata/name").to_owned();

    let started = std::time::Instant::now();
    apis.claims.create(&pp, &claim("c", "pool")).await.expect("the claim");
    let bound = until_one(&apis.claims, "c", "the claim bound", |c| {
        c.is_some_and(|c| !s(c, "/status/sandbox/name").is_empty())
    })
    .await
    .expect("the claim");
    assert_eq!(s(&bound, "/status/sandbox/name"), "c", "a cold sandbox, not {warm}");
    // The grace counts from creationTimestamp, which has whole seconds (as
    // on a real server): 2 s of it is more than 1 s of ours.
    assert!(started.elapsed() >= std::time::Duration::from_secs(1), "after the grace: {:?}", started.elapsed());
    assert_eq!(condition(&bound, "Ready").0, "False");
    let member = value(apis.sandboxes.get(&warm).await.expect("the member"));
    assert_eq!(controller(&member), ("SandboxWarmPool", "pool"), "still the pool's");
}
