//! The fake Kubernetes cluster (`standby_e2e::kube_fake`) driven by the
//! real `kube::Client`: each semantic the Kubernetes provider relies on,
//! proven against what kube itself sends and expects.

use std::collections::BTreeMap;
use std::path::Path;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, AttachParams, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use serde_json::json;
use standby_e2e::kube_fake::{Call, FakeCluster, FakeOptions};

mod kube_fake_agent_sandbox;
mod kube_fake_pods;
mod kube_fake_support;

use kube_fake_support::{api_code, cluster, config_map, eventually, in_time, options, pod, running};

#[tokio::test]
async fn create_get_and_list_with_a_label_selector() {
    let (_cluster, client) = cluster().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    let created = cms.create(&PostParams::default(), &config_map("a", &[("app", "x")])).await.expect("create a");
    cms.create(&PostParams::default(), &config_map("b", &[("app", "y")])).await.expect("create b");
    cms.create(&PostParams::default(), &config_map("c", &[])).await.expect("create c");
    let meta = &created.metadata;
    assert!(meta.uid.is_some() && meta.creation_timestamp.is_some(), "{meta:?}");
    assert_eq!(meta.namespace.as_deref(), Some("standby"));
    assert_eq!(meta.generation, Some(1));
    assert_eq!(cms.get("a").await.expect("get a").metadata.resource_version, meta.resource_version);

    let names = |list: kube::api::ObjectList<ConfigMap>| -> Vec<String> {
        list.items.into_iter().filter_map(|c| c.metadata.name).collect()
    };
    let all = cms.list(&ListParams::default()).await.expect("list");
    let list_rv: u64 = all.metadata.resource_version.clone().expect("a list version").parse().expect("a number");
    assert!(list_rv >= meta.resource_version.clone().expect("a version").parse::<u64>().expect("a number"));
    assert_eq!(names(all), ["a", "b", "c"]);
    assert_eq!(names(cms.list(&ListParams::default().labels("app=x")).await.expect("list")), ["a"]);
    assert_eq!(names(cms.list(&ListParams::default().labels("app!=x")).await.expect("list")), ["b", "c"]);
    assert_eq!(names(cms.list(&ListParams::default().labels("app")).await.expect("list")), ["a", "b"]);
    assert_eq!(names(cms.list(&ListParams::default().labels("!app")).await.expect("list")), ["c"]);
    assert_eq!(names(cms.list(&ListParams::default().labels("app in (x,y)")).await.expect("list")), ["a", "b"]);
    assert_eq!(names(cms.list(&ListParams::default().fields("metadata.name=b")).await.expect("list")), ["b"]);

    let generated: ConfigMap =
        serde_json::from_value(json!({ "metadata": { "generateName": "gen-" } })).expect("a config map");
    let generated = cms.create(&PostParams::default(), &generated).await.expect("create with generateName");
    assert!(generated.metadata.name.as_deref().is_some_and(|n| n.starts_with("gen-") && n.len() == 9));

    assert_eq!(api_code(cms.get("missing").await.expect_err("missing")), (404, "NotFound".into()));
    let nameless = cms.create(&PostParams::default(), &ConfigMap::default()).await.expect_err("no name");
    assert_eq!(api_code(nameless), (422, "Invalid".into()));
}

#[tokio::test]
async fn update_with_a_stale_version_is_a_conflict_and_create_twice_already_exists() {
    let (_cluster, client) = cluster().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    let first = cms.create(&PostParams::default(), &config_map("a", &[])).await.expect("create");
    let again = cms.create(&PostParams::default(), &config_map("a", &[])).await.expect_err("twice");
    assert_eq!(api_code(again), (409, "AlreadyExists".into()));

    let mut newer = first.clone();
    newer.data = Some(BTreeMap::from([("k".into(), "w".into())]));
    let newer = cms.replace("a", &PostParams::default(), &newer).await.expect("update");
    assert_ne!(newer.metadata.resource_version, first.metadata.resource_version);
    let stale = cms.replace("a", &PostParams::default(), &first).await.expect_err("stale");
    match stale {
        kube::Error::Api(status) => {
            assert_eq!((status.code, status.reason.as_str()), (409, "Conflict"));
            assert!(status.message.contains("the object has been modified"), "{}", status.message);
        }
        other => panic!("not an API error: {other}"),
    }

    let patched = cms
        .patch("a", &PatchParams::default(), &Patch::Merge(json!({ "data": { "k": null, "n": "1" } })))
        .await
        .expect("merge patch");
    assert_eq!(patched.data, Some(BTreeMap::from([("n".into(), "1".into())])));
    let applied = cms
        .patch("b", &PatchParams::apply("test"), &Patch::Apply(config_map("b", &[("via", "apply")])))
        .await
        .expect("apply creates");
    assert_eq!(applied.metadata.labels.expect("labels")["via"], "apply");
}

#[tokio::test]
async fn a_watch_gets_bookmarks() {
    let (_cluster, client) = cluster().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    cms.create(&PostParams::default(), &config_map("a", &[])).await.expect("create");
    let mut events = cms.watch(&WatchParams::default().timeout(10), "0").await.expect("watch").boxed();
    let mut added = false;
    in_time("a bookmark", async {
        loop {
            match events.try_next().await.expect("an event").expect("the stream goes on") {
                WatchEvent::Added(cm) => added |= cm.metadata.name.as_deref() == Some("a"),
                WatchEvent::Bookmark(bookmark) => {
                    assert!(!bookmark.metadata.resource_version.is_empty());
                    return;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    })
    .await;
    assert!(added, "a watch from \"0\" starts with the current objects");
}

#[tokio::test]
async fn a_watch_from_a_compacted_version_gets_410() {
    let (cluster, client) = cluster().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    let created = cms.create(&PostParams::default(), &config_map("a", &[])).await.expect("create");
    let rv = created.metadata.resource_version.expect("a version");

    // Resumed from a kept version: the changes after it replay.
    cms.create(&PostParams::default(), &config_map("b", &[])).await.expect("create");
    let mut events = cms.watch(&WatchParams::default(), &rv).await.expect("watch").boxed();
    match in_time("the replay", events.try_next()).await.expect("an event") {
        Some(WatchEvent::Added(cm)) => assert_eq!(cm.metadata.name.as_deref(), Some("b")),
        other => panic!("unexpected {other:?}"),
    }

    cluster.expire_watches().await;
    assert!(in_time("the watch ends", events.try_next()).await.expect("no error").is_none());
    let mut events = cms.watch(&WatchParams::default(), &rv).await.expect("watch").boxed();
    match in_time("an event", events.try_next()).await.expect("an event") {
        Some(WatchEvent::Error(e)) => {
            assert_eq!(e.code, 410);
            assert!(e.message.starts_with(&format!("too old resource version: {rv} (")), "{}", e.message);
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(in_time("the end", events.try_next()).await.expect("no error").is_none());

    // The kept history is bounded by `history`.
    let small = FakeCluster::start(FakeOptions { history: 2, ..options() }).await;
    let cms: Api<ConfigMap> = Api::default_namespaced(small.client().await);
    let first = cms.create(&PostParams::default(), &config_map("a", &[])).await.expect("create");
    for name in ["b", "c", "d"] {
        cms.create(&PostParams::default(), &config_map(name, &[])).await.expect("create");
    }
    let rv = first.metadata.resource_version.expect("a version");
    let mut events = cms.watch(&WatchParams::default(), &rv).await.expect("watch").boxed();
    match in_time("an event", events.try_next()).await.expect("an event") {
        Some(WatchEvent::Error(e)) => assert_eq!(e.code, 410),
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test]
async fn the_watcher_relists_after_expired_watches() {
    let (cluster, client) = cluster().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    let (reader, writer) = reflector::store();
    let stream = reflector(writer, watcher(cms.clone(), watcher::Config::default())).default_backoff();
    let driver = tokio::spawn(stream.for_each(|_| async {}));
    let has = |name: &str| reader.state().iter().any(|cm| cm.metadata.name.as_deref() == Some(name));

    cms.create(&PostParams::default(), &config_map("before", &[])).await.expect("create");
    eventually("the store has the first", || has("before")).await;
    let lists = |cluster: &FakeCluster| cluster.calls().iter().filter(|c| c.verb == "list").count();
    let lists_before = lists(&cluster);

    cluster.expire_watches().await;
    cms.create(&PostParams::default(), &config_map("after", &[])).await.expect("create");
    eventually("the store has the one created after the expiry", || has("after")).await;
    assert!(lists(&cluster) > lists_before, "the watcher re-listed: {:?}", cluster.calls());
    cms.delete("before", &DeleteParams::default()).await.expect("delete");
    eventually("the store lost the deleted one", || !has("before")).await;
    driver.abort();
}

#[tokio::test]
async fn the_calls_name_rbac_verbs() {
    let (cluster, client) = cluster().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(client.clone());
    let pods: Api<Pod> = Api::default_namespaced(client);
    let cm = cms.create(&PostParams::default(), &config_map("a", &[("app", "x")])).await.expect("create");
    cms.get("a").await.expect("get");
    cms.list(&ListParams::default()).await.expect("list");
    let mut w = cms.watch(&WatchParams::default().timeout(1), "0").await.expect("watch").boxed();
    let _ = w.try_next().await;
    cms.replace("a", &PostParams::default(), &cm).await.expect("update");
    cms.patch("a", &PatchParams::default(), &Patch::Merge(json!({ "data": { "n": "1" } }))).await.expect("patch");
    cms.delete("a", &DeleteParams::default()).await.expect("delete");
    cms.delete_collection(&DeleteParams::default(), &ListParams::default()).await.expect("deletecollection");
    pods.create(&PostParams::default(), &pod("p", "sleep 1000", None)).await.expect("create");
    running(&pods, "p").await;
    let mut attached = pods.exec("p", ["true"], &AttachParams::default()).await.expect("exec");
    in_time("exec", attached.take_status().expect("a status")).await;

    let call = |verb: &str, resource: &str| Call {
        verb: verb.into(),
        group: String::new(),
        resource: resource.into(),
        namespace: Some("standby".into()),
    };
    let calls = cluster.calls();
    let expected = [
        call("create", "configmaps"),
        call("get", "configmaps"),
        call("list", "configmaps"),
        call("watch", "configmaps"),
        call("update", "configmaps"),
        call("patch", "configmaps"),
        call("delete", "configmaps"),
        call("deletecollection", "configmaps"),
        call("create", "pods"),
        call("create", "pods/exec"),
    ];
    let mut at = 0;
    for call in &calls {
        if at < expected.len() && *call == expected[at] {
            at += 1;
        }
    }
    assert_eq!(at, expected.len(), "in order: {expected:?}\nserved: {calls:?}");
}

#[tokio::test]
async fn the_kubeconfig_reaches_the_server() {
    let cluster = FakeCluster::start(options()).await;
    let dir = tempfile::tempdir().expect("a temp dir");
    let path: &Path = &dir.path().join("kubeconfig");
    cluster.write_kubeconfig(path);
    let kubeconfig = kube::config::Kubeconfig::read_from(path).expect("a kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await.expect("a config");
    assert_eq!(config.default_namespace, "standby");
    let client = kube::Client::try_from(config).expect("a client");
    let version = client.apiserver_version().await.expect("the version");
    assert_eq!((version.major.as_str(), version.minor.as_str()), ("1", "33"));
}

#[tokio::test]
async fn status_is_a_subresource_and_a_selector_watch_sees_objects_leave() {
    let (_cluster, client) = cluster().await;
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    pods.create(&PostParams::default(), &pod("p", "sleep 1000", None)).await.expect("create");
    let mut pod = running(&pods, "p").await;
    pod.status.as_mut().expect("a status").phase = Some("Failed".into());
    let replaced = pods.replace("p", &PostParams::default(), &pod).await.expect("update");
    assert_eq!(replaced.status.and_then(|s| s.phase).as_deref(), Some("Running"), "PUT keeps the status");
    let patched = pods
        .patch_status("p", &PatchParams::default(), &Patch::Merge(json!({ "status": { "message": "hi" } })))
        .await
        .expect("patch status");
    assert_eq!(patched.status.and_then(|s| s.message).as_deref(), Some("hi"));

    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    cms.create(&PostParams::default(), &config_map("a", &[("app", "x")])).await.expect("create");
    let list = cms.list(&ListParams::default()).await.expect("list");
    let rv = list.metadata.resource_version.expect("a version");
    let wp = WatchParams::default().labels("app=x");
    let mut events = cms.watch(&wp, &rv).await.expect("watch").boxed();
    cms.patch("a", &PatchParams::default(), &Patch::Merge(json!({ "metadata": { "labels": { "app": "y" } } })))
        .await
        .expect("relabel");
    match in_time("an event", events.try_next()).await.expect("an event") {
        Some(WatchEvent::Deleted(cm)) => assert_eq!(cm.metadata.name.as_deref(), Some("a")),
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test]
async fn a_streaming_list_watcher_gets_its_initial_events() {
    let (_cluster, client) = cluster().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(client);
    cms.create(&PostParams::default(), &config_map("a", &[])).await.expect("create");
    let config = watcher::Config::default().streaming_lists();
    let mut events = watcher(cms.clone(), config).boxed();
    in_time("the initial events", async {
        let mut seen = Vec::new();
        loop {
            match events.try_next().await.expect("an event").expect("the stream goes on") {
                watcher::Event::InitApply(cm) => seen.extend(cm.metadata.name),
                watcher::Event::InitDone => break,
                _ => {}
            }
        }
        assert_eq!(seen, ["a"]);
    })
    .await;
    cms.create(&PostParams::default(), &config_map("b", &[])).await.expect("create");
    match in_time("a live event", events.try_next()).await.expect("an event") {
        Some(watcher::Event::Apply(cm)) => assert_eq!(cm.metadata.name.as_deref(), Some("b")),
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test]
async fn a_pod_spec_is_immutable_and_secret_string_data_is_folded() {
    let (_cluster, client) = cluster().await;
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    pods.create(&PostParams::default(), &pod("p", "sleep 1000", None)).await.expect("create");
    let change = Patch::Merge(json!({ "spec": { "containers": [{ "name": "main", "command": ["/bin/true"] }] } }));
    let refused = pods.patch("p", &PatchParams::default(), &change).await.expect_err("spec change");
    assert_eq!(api_code(refused), (422, "Invalid".into()));
    let labels = Patch::Merge(json!({ "metadata": { "labels": { "more": "yes" } } }));
    pods.patch("p", &PatchParams::default(), &labels).await.expect("labels may change");

    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::default_namespaced(client);
    let secret =
        serde_json::from_value(json!({ "metadata": { "name": "s" }, "stringData": { "k": "v" } })).expect("a secret");
    let created = secrets.create(&PostParams::default(), &secret).await.expect("create");
    assert!(created.string_data.is_none());
    assert_eq!(created.data.expect("data")["k"].0, b"v");
}
