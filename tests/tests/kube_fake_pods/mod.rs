//! The fake kubelet and exec, driven by the real `kube::Client`: pods as
//! processes in their own PID namespace, their statuses, graceful deletion,
//! eviction, a lost node, PVCs and emptyDirs, restarts, and exec over the
//! WebSocket channel protocol.

use std::path::Path;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::api::{Api, AttachParams, DeleteParams, PostParams, WatchEvent, WatchParams};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::kube_fake_support::{
    alive, api_code, claim, cluster, eventually, gone, in_time, logs_contain, namespace_members, pod, running, until,
};

#[tokio::test]
async fn a_pod_runs_as_pid_1_of_its_own_namespace() {
    let (cluster, client) = cluster().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    let created = pods.create(&PostParams::default(), &pod("p", "echo $FOO; sleep 1000", None)).await.expect("create");
    assert_eq!(created.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Pending"));
    let pod = running(&pods, "p").await;
    let status = pod.status.expect("a status");
    assert_eq!(status.pod_ip.as_deref(), Some("127.0.0.1"));
    assert_eq!(pod.spec.expect("a spec").node_name.as_deref(), Some("fake-node"));
    let ready = status.conditions.expect("conditions").into_iter().find(|c| c.type_ == "Ready").expect("Ready");
    assert_eq!(ready.status, "True");
    let container = &status.container_statuses.expect("container statuses")[0];
    assert!(container.ready && container.state.as_ref().and_then(|s| s.running.as_ref()).is_some());
    logs_contain(&pods, "p", "bar").await;

    let pid1 = cluster.pod_processes("p").expect("the pod's PID 1");
    let nspid = std::fs::read_to_string(format!("/proc/{pid1}/status")).expect("its status");
    let nspid = nspid.lines().find(|l| l.starts_with("NSpid:")).expect("NSpid");
    assert!(nspid.ends_with("\t1"), "PID 1 in its own namespace: {nspid}");
    let environ = std::fs::read(format!("/proc/{pid1}/environ")).expect("its environment");
    let environ: Vec<&[u8]> = environ.split(|b| *b == 0).filter(|e| !e.is_empty()).collect();
    assert!(environ.contains(&&b"FOO=bar"[..]) && environ.contains(&&b"HOSTNAME=p"[..]));
    assert_eq!(environ.len(), 4, "FOO, DIR, PATH, HOSTNAME only");

    drop(cluster);
    eventually("the pod's processes die with the cluster", || !alive(pid1)).await;
}

#[tokio::test]
async fn exec_cat_returns_its_stdin_and_succeeds() {
    let (_cluster, client) = cluster().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    pods.create(&PostParams::default(), &pod("p", "sleep 1000", None)).await.expect("create");
    running(&pods, "p").await;

    let mut attached = pods.exec("p", ["cat"], &AttachParams::default().stdin(true).stderr(false)).await.expect("exec");
    let mut stdin = attached.stdin().expect("stdin");
    let mut stdout = attached.stdout().expect("stdout");
    let status = attached.take_status().expect("a status");
    let read = tokio::spawn(async move {
        let mut out = Vec::new();
        stdout.read_to_end(&mut out).await.expect("read stdout");
        out
    });
    let text = "hello\n".repeat(2000);
    stdin.write_all(text.as_bytes()).await.expect("write stdin");
    // kube sends stdin's end (v5: the frame [255, 0]) on shutdown, not on drop.
    stdin.shutdown().await.expect("close stdin");
    let status = in_time("the status", status).await.expect("a status");
    assert_eq!(status.status.as_deref(), Some("Success"), "{status:?}");
    assert_eq!(in_time("stdout", read).await.expect("the reader"), text.as_bytes());
}

#[tokio::test]
async fn exec_exit_3_is_a_non_zero_exit_code_status() {
    let (_cluster, client) = cluster().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    pods.create(&PostParams::default(), &pod("p", "sleep 1000", None)).await.expect("create");
    running(&pods, "p").await;
    let mut attached = pods
        .exec("p", ["sh", "-c", "echo out; echo err >&2; echo $FOO; exit 3"], &AttachParams::default())
        .await
        .expect("exec");
    let (mut stdout, mut stderr) = (attached.stdout().expect("stdout"), attached.stderr().expect("stderr"));
    let status = attached.take_status().expect("a status");
    let (mut out, mut err) = (String::new(), String::new());
    let (o, e) = tokio::join!(stdout.read_to_string(&mut out), stderr.read_to_string(&mut err));
    o.and(e).expect("read the output");
    assert_eq!((out.as_str(), err.as_str()), ("out\nbar\n", "err\n"), "the container's env, both streams");
    let status = in_time("the status", status).await.expect("a status");
    assert_eq!(status.status.as_deref(), Some("Failure"));
    assert_eq!(status.reason.as_deref(), Some("NonZeroExitCode"));
    let causes = status.details.and_then(|d| d.causes).expect("causes");
    assert_eq!(causes[0].reason.as_deref(), Some("ExitCode"));
    assert_eq!(causes[0].message.as_deref(), Some("3"));

    let missing = pods.exec("nope", ["true"], &AttachParams::default()).await.err().expect("no such pod");
    assert_eq!(api_code(missing).0, 404);
}

#[tokio::test]
async fn an_exec_background_process_dies_with_its_pod() {
    let (cluster, client) = cluster().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    // `exec`: dash forks a `-c` command, and a fork made after the pod is
    // Running would count as the exec's process. The pod is only PID 1.
    let created = pods.create(&PostParams::default(), &pod("p", "exec sleep 1000", None)).await.expect("create");
    running(&pods, "p").await;
    let pid1 = cluster.pod_processes("p").expect("PID 1");
    let before = namespace_members(pid1);
    assert_eq!(before, [pid1], "the pod's only process is its PID 1");
    let mut attached = pods
        .exec("p", ["sh", "-c", "sleep 1000 </dev/null >/dev/null 2>&1 &"], &AttachParams::default().stderr(false))
        .await
        .expect("exec");
    let status = in_time("the status", attached.take_status().expect("a status")).await.expect("a status");
    assert_eq!(status.status.as_deref(), Some("Success"));
    let background: Vec<u32> = namespace_members(pid1).into_iter().filter(|p| !before.contains(p)).collect();
    assert_eq!(background.len(), 1, "the background sleep runs in the pod's PID namespace");

    pods.delete("p", &DeleteParams::default()).await.expect("delete");
    gone(&pods, "p", &created.metadata.uid.expect("a uid")).await;
    eventually("the background process is gone", || !alive(background[0]) && !alive(pid1)).await;
}

#[tokio::test]
async fn a_graceful_delete_terms_pid_1_then_removes_the_pod() {
    let (cluster, client) = cluster().await;
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    let claims: Api<PersistentVolumeClaim> = Api::default_namespaced(client);
    claims.create(&PostParams::default(), &claim("c")).await.expect("create the claim");
    let script = "trap 'echo term > \"$DIR/term\"; exit 0' TERM; echo started; sleep 1000 & wait";
    let mut spec = pod("p", script, Some("c"));
    spec.spec.as_mut().expect("a spec").termination_grace_period_seconds = Some(20);
    let created = pods.create(&PostParams::default(), &spec).await.expect("create");
    running(&pods, "p").await;
    logs_contain(&pods, "p", "started").await;

    let deleting = pods.delete("p", &DeleteParams::default()).await.expect("delete");
    let deleting = deleting.left().expect("the pod is only marked: it has a container to stop");
    assert!(deleting.metadata.deletion_timestamp.is_some());
    assert_eq!(deleting.metadata.deletion_grace_period_seconds, Some(20));
    gone(&pods, "p", &created.metadata.uid.expect("a uid")).await;
    let term = std::fs::read_to_string(cluster.pvc_dir("c").join("term")).expect("the TERM trap wrote");
    assert_eq!(term, "term\n");
}

#[tokio::test]
async fn eviction_fails_the_pod_then_deletes_it() {
    let (cluster, client) = cluster().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    let created = pods.create(&PostParams::default(), &pod("p", "sleep 1000", None)).await.expect("create");
    running(&pods, "p").await;
    let pid1 = cluster.pod_processes("p").expect("PID 1");
    let mut events = pods.watch(&WatchParams::default(), "0").await.expect("watch").boxed();
    cluster.evict("p").await;
    assert!(!alive(pid1), "killed before evict returns");
    let mut evicted = false;
    in_time("the eviction's events", async {
        while let Some(event) = events.try_next().await.expect("an event") {
            match event {
                WatchEvent::Modified(p) => {
                    let status = p.status.expect("a status");
                    evicted |= status.phase.as_deref() == Some("Failed") && status.reason.as_deref() == Some("Evicted");
                }
                WatchEvent::Deleted(_) => return,
                _ => {}
            }
        }
    })
    .await;
    assert!(evicted, "the pod was Failed/Evicted before it was deleted");
    gone(&pods, "p", &created.metadata.uid.expect("a uid")).await;
}

#[tokio::test]
async fn a_pvc_dir_outlives_its_pod_and_goes_with_the_pvc() {
    let (cluster, client) = cluster().await;
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    let claims: Api<PersistentVolumeClaim> = Api::default_namespaced(client);

    // A pod whose claim does not exist yet waits, then runs once it does.
    let created = pods
        .create(&PostParams::default(), &pod("p", "echo kept > $DIR/file; sleep 1000", Some("c")))
        .await
        .expect("create");
    until(&pods, "p", "unschedulable", |p: Option<&Pod>| {
        p.and_then(|p| p.status.as_ref()?.conditions.as_ref()?.first().cloned())
            .is_some_and(|c| c.reason.as_deref() == Some("Unschedulable"))
    })
    .await;
    let bound = claims.create(&PostParams::default(), &claim("c")).await.expect("create the claim");
    assert_eq!(bound.status.and_then(|s| s.phase).as_deref(), Some("Bound"));
    running(&pods, "p").await;
    let dir = cluster.pvc_dir("c");
    eventually("the pod wrote into its claim", || dir.join("file").exists()).await;

    // In use: the claim waits for the pod (PVC protection).
    claims.delete("c", &DeleteParams::default()).await.expect("delete the claim");
    assert!(claims.get("c").await.expect("still there").metadata.deletion_timestamp.is_some());
    pods.delete("p", &DeleteParams::default().grace_period(0)).await.expect("delete the pod");
    gone(&pods, "p", &created.metadata.uid.expect("a uid")).await;
    eventually("the claim goes once no pod uses it", || !dir.exists()).await;
    assert_eq!(api_code(claims.get("c").await.expect_err("gone")).0, 404);

    // Unused: the directory outlives a pod and goes with the claim.
    claims.create(&PostParams::default(), &claim("d")).await.expect("create");
    let done = pods.create(&PostParams::default(), &pod("q", "echo x > $DIR/f", Some("d"))).await.expect("create");
    until(&pods, "q", "the pod succeeds", |p: Option<&Pod>| {
        p.and_then(|p| p.status.as_ref()?.phase.clone()).as_deref() == Some("Succeeded")
    })
    .await;
    pods.delete("q", &DeleteParams::default()).await.expect("delete");
    gone(&pods, "q", &done.metadata.uid.expect("a uid")).await;
    assert!(cluster.pvc_dir("d").join("f").exists());
    claims.delete("d", &DeleteParams::default()).await.expect("delete");
    assert!(!cluster.pvc_dir("d").exists());
}

#[tokio::test]
async fn a_lost_node_fails_every_pod_then_deletes_it() {
    let (cluster, client) = cluster().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    let created = pods.create(&PostParams::default(), &pod("p", "sleep 1000", None)).await.expect("create");
    running(&pods, "p").await;
    let pid1 = cluster.pod_processes("p").expect("PID 1");
    cluster.lose_node().await;
    assert!(!alive(pid1));
    let lost = pods.get("p").await.expect("still there for now").status.expect("a status");
    assert_eq!(lost.phase.as_deref(), Some("Unknown"));
    let ready = lost.conditions.expect("conditions").into_iter().find(|c| c.type_ == "Ready").expect("Ready");
    assert_eq!((ready.status.as_str(), ready.reason.as_deref()), ("False", Some("NodeLost")));
    gone(&pods, "p", &created.metadata.uid.expect("a uid")).await;
}

#[tokio::test]
async fn a_privileged_container_is_refused() {
    let (_cluster, client) = cluster().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    let mut spec = pod("p", "true", None);
    let container = &mut spec.spec.as_mut().expect("a spec").containers[0];
    container.security_context = Some(serde_json::from_value(json!({ "privileged": true })).expect("a context"));
    let refused = pods.create(&PostParams::default(), &spec).await.expect_err("privileged");
    assert_eq!(api_code(refused), (422, "Invalid".into()));
}

#[tokio::test]
async fn an_exec_ends_when_its_pod_is_evicted() {
    let (cluster, client) = cluster().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    pods.create(&PostParams::default(), &pod("p", "sleep 1000", None)).await.expect("create");
    running(&pods, "p").await;
    let mut attached =
        pods.exec("p", ["sh", "-c", "echo up; sleep 1000"], &AttachParams::default()).await.expect("exec");
    let mut stdout = attached.stdout().expect("stdout");
    let mut up = [0u8; 3];
    in_time("the exec runs", stdout.read_exact(&mut up)).await.expect("read");
    let status = attached.take_status().expect("a status");
    cluster.evict("p").await;
    let status = in_time("the exec ends with its pod", status).await.expect("a status");
    assert_eq!(status.reason.as_deref(), Some("NonZeroExitCode"), "{status:?}");
    let causes = status.details.and_then(|d| d.causes).expect("causes");
    assert_eq!(causes[0].message.as_deref(), Some("137"), "SIGKILLed");
}

#[tokio::test]
async fn a_container_that_cannot_start_says_why() {
    let (_cluster, client) = cluster().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    let waiting = |pod: Option<&Pod>| {
        pod.and_then(|p| p.status.as_ref()?.container_statuses.as_ref()?.first()?.state.as_ref()?.waiting.clone())
            .and_then(|w| w.reason)
    };

    let mut unknown_image = pod("image", "true", None);
    let container = &mut unknown_image.spec.as_mut().expect("a spec").containers[0];
    (container.image, container.command) = (Some("nope:1".into()), None);
    let mut unknown_binary = pod("binary", "true", None);
    unknown_binary.spec.as_mut().expect("a spec").containers[0].command = Some(vec!["/nope".into()]);
    let mut value_from = pod("secret", "true", None);
    value_from.spec.as_mut().expect("a spec").containers[0].env = Some(vec![
        serde_json::from_value(json!({ "name": "S", "valueFrom": { "secretKeyRef": { "name": "s", "key": "k" } } }))
            .expect("an env var"),
    ]);
    for (pod, reason) in [
        (unknown_image, "ErrImagePull"),
        (unknown_binary, "CreateContainerError"),
        (value_from, "CreateContainerConfigError"),
    ] {
        let name = pod.metadata.name.clone().expect("a name");
        pods.create(&PostParams::default(), &pod).await.expect("create");
        let pod = until(&pods, &name, reason, |p: Option<&Pod>| waiting(p).as_deref() == Some(reason)).await;
        let status = pod.and_then(|p| p.status).expect("a status");
        assert_eq!(status.phase.as_deref(), Some("Pending"), "{name}");
    }

    let mut two = pod("two", "true", None);
    let spec = two.spec.as_mut().expect("a spec");
    let mut second = spec.containers[0].clone();
    second.name = "second".into();
    spec.containers.push(second);
    pods.create(&PostParams::default(), &two).await.expect("create");
    let failed = until(&pods, "two", "failed", |p: Option<&Pod>| {
        p.and_then(|p| p.status.as_ref()?.phase.clone()).as_deref() == Some("Failed")
    })
    .await;
    let message = failed.and_then(|p| p.status?.message).expect("a message");
    assert!(message.contains("exactly one container"), "{message}");
}

#[tokio::test]
async fn exec_speaks_v4_to_a_client_without_v5() {
    use tokio_tungstenite::tungstenite::{Message, client::IntoClientRequest, http::HeaderValue};
    let (cluster, client) = cluster().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    pods.create(&PostParams::default(), &pod("p", "sleep 1000", None)).await.expect("create");
    running(&pods, "p").await;
    let url = format!(
        "{}/api/v1/namespaces/standby/pods/p/exec?command=sh&command=-c&command=echo+hi%3B+exit+2&stdout=true",
        cluster.url().replacen("http", "ws", 1)
    );
    let mut request = url.into_client_request().expect("a request");
    request.headers_mut().insert("Sec-WebSocket-Protocol", HeaderValue::from_static("v4.channel.k8s.io"));
    let (mut socket, response) = tokio_tungstenite::connect_async(request).await.expect("upgrade");
    assert_eq!(response.headers()["Sec-WebSocket-Protocol"], "v4.channel.k8s.io");
    let mut frames = Vec::new();
    in_time("the frames", async {
        while let Some(Ok(message)) = socket.next().await {
            if let Message::Binary(b) = message {
                frames.push(b.to_vec());
            }
        }
    })
    .await;
    assert_eq!(frames[0], b"\x01hi\n");
    let status: serde_json::Value = serde_json::from_slice(&frames[1][1..]).expect("a status");
    assert_eq!((frames[1][0], status["details"]["causes"][0]["message"].as_str()), (3, Some("2")));
}

#[tokio::test]
async fn an_empty_dir_maps_env_and_working_dir_and_the_eviction_api_deletes() {
    let (_cluster, client) = cluster().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    let mut spec = pod("p", "pwd; echo \"dir=$DIR\"; touch here; sleep 1000", None);
    let pod_spec = spec.spec.as_mut().expect("a spec");
    pod_spec.volumes =
        Some(vec![serde_json::from_value(json!({ "name": "scratch", "emptyDir": {} })).expect("a volume")]);
    let container = &mut pod_spec.containers[0];
    container.volume_mounts =
        Some(vec![serde_json::from_value(json!({ "name": "scratch", "mountPath": "/scratch" })).expect("a mount")]);
    container.working_dir = Some("/scratch".into());
    container.env = Some(vec![serde_json::from_value(json!({ "name": "DIR", "value": "/scratch/sub" })).expect("env")]);
    let created = pods.create(&PostParams::default(), &spec).await.expect("create");
    running(&pods, "p").await;
    logs_contain(&pods, "p", "dir=").await;
    let log = pods.logs("p", &Default::default()).await.expect("the log");
    let lines: Vec<&str> = log.lines().collect();
    let host_dir = lines[0];
    assert!(host_dir.ends_with("/scratch") && host_dir != "/scratch", "the working dir is mapped: {log}");
    assert_eq!(lines[1], format!("dir={host_dir}/sub"), "env values below a mount path are mapped");
    eventually("the file is in the emptyDir", || Path::new(host_dir).join("here").exists()).await;

    pods.evict("p", &Default::default()).await.expect("the eviction API");
    let marked = pods.get("p").await.expect("terminating, still there");
    assert!(marked.metadata.deletion_timestamp.is_some());
    gone(&pods, "p", &created.metadata.uid.expect("a uid")).await;
    eventually("the emptyDir goes with its pod", || !Path::new(host_dir).exists()).await;
}

#[tokio::test]
async fn restart_policy_always_restarts_after_a_back_off() {
    let (_cluster, client) = cluster().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    let mut spec = pod("p", "echo run; exit 1", None);
    spec.spec.as_mut().expect("a spec").restart_policy = Some("Always".into());
    let created = pods.create(&PostParams::default(), &spec).await.expect("create");
    let restarted = until(&pods, "p", "a restart", |p: Option<&Pod>| {
        p.and_then(|p| p.status.as_ref()?.container_statuses.as_ref()?.first().map(|c| c.restart_count))
            .is_some_and(|n| n >= 1)
    })
    .await
    .expect("the pod");
    let status = restarted.status.expect("a status");
    assert_eq!(status.phase.as_deref(), Some("Running"), "a restarting pod stays Running");
    let container = &status.container_statuses.expect("container statuses")[0];
    let last = container.last_state.as_ref().and_then(|s| s.terminated.as_ref()).expect("the last run's end");
    assert_eq!(last.exit_code, 1);
    logs_contain(&pods, "p", "run\nrun\n").await;

    pods.delete("p", &DeleteParams::default()).await.expect("delete");
    gone(&pods, "p", &created.metadata.uid.expect("a uid")).await;
}

#[tokio::test]
async fn exec_into_a_pod_not_running_is_refused_before_the_upgrade() {
    let (_cluster, client) = cluster().await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    let mut pending = pod("pending", "true", None);
    pending.spec.as_mut().expect("a spec").containers[0].command = Some(vec!["/nope".into()]);
    pods.create(&PostParams::default(), &pending).await.expect("create");
    let refused = pods.exec("pending", ["true"], &AttachParams::default()).await.err().expect("not running");
    assert_eq!(api_code(refused), (400, "BadRequest".into()));

    pods.create(&PostParams::default(), &pod("done", "exit 0", None)).await.expect("create");
    until(&pods, "done", "done", |p: Option<&Pod>| {
        p.and_then(|p| p.status.as_ref()?.phase.clone()).as_deref() == Some("Succeeded")
    })
    .await;
    let refused = pods.exec("done", ["true"], &AttachParams::default()).await.err().expect("completed");
    match refused {
        kube::Error::Api(status) => assert!(status.message.contains("completed pod"), "{}", status.message),
        other => panic!("not an API error: {other}"),
    }

    pods.create(&PostParams::default(), &pod("p", "sleep 1000", None)).await.expect("create");
    running(&pods, "p").await;
    let mut attached = pods.exec("p", ["/no/such/tool"], &AttachParams::default()).await.expect("upgraded");
    let status = in_time("the status", attached.take_status().expect("a status")).await.expect("a status");
    assert_eq!(status.status.as_deref(), Some("Failure"));
    assert!(status.message.as_deref().is_some_and(|m| m.contains("executable file not found")), "{status:?}");
}
