//! The Kubernetes deployment (`deploy/kubernetes`, docs/deploy.md
//! "Kubernetes") as `kubectl kustomize` renders it: the server replicated
//! with probes, its secrets only from Secrets, a configuration file for the
//! kubernetes provider, a sandbox pod template with nothing secret and the
//! strict securityContext, the NetworkPolicies, and a Role granting the
//! provider's calls and nothing more. Nothing is applied to a cluster.

use std::collections::BTreeSet;

use serde_json::Value;
use standby_e2e::kustomize::{self, deploy_dir, kubectl_available, object, objects, role_grants};

const NAMESPACE: &str = "standby";
const SERVICE: &str = "standby";
const DEPLOYMENT: &str = "standby-server";
const SERVICE_ACCOUNT: &str = "standby-server";
const PORT: i64 = 8080;
const SANDBOX_LABEL: (&str, &str) = ("standby.dev/role", "sandbox");
const PRIVATE_RANGES: [&str; 4] = ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16"];

fn rendered(test: &str) -> Option<Vec<Value>> {
    if !kubectl_available(test) {
        return None;
    }
    Some(kustomize::render(&deploy_dir()).unwrap_or_else(|error| panic!("{error}")))
}

fn grant(group: &str, resource: &str, verb: &str) -> (String, String, String) {
    (group.to_owned(), resource.to_owned(), verb.to_owned())
}

fn strings(value: &Value) -> Vec<&str> {
    value.as_array().into_iter().flatten().filter_map(Value::as_str).collect()
}

fn server_pod(rendered: &[Value]) -> &Value {
    &object(rendered, "Deployment", DEPLOYMENT)["spec"]["template"]["spec"]
}

fn server_container(rendered: &[Value]) -> &Value {
    let containers = server_pod(rendered)["containers"].as_array().expect("containers");
    assert_eq!(containers.len(), 1, "one container in the server's pod: {containers:?}");
    &containers[0]
}

/// The one ConfigMap generated as `prefix-<hash>`.
fn config_map<'a>(rendered: &'a [Value], prefix: &str) -> &'a Value {
    let found: Vec<&Value> = objects(rendered, "ConfigMap")
        .into_iter()
        .filter(|map| map["metadata"]["name"].as_str().is_some_and(|name| name.starts_with(&format!("{prefix}-"))))
        .collect();
    assert_eq!(found.len(), 1, "one ConfigMap {prefix}-…: {found:?}");
    found[0]
}

fn config(rendered: &[Value]) -> toml::Table {
    let text =
        config_map(rendered, "standby-config")["data"]["config.toml"].as_str().expect("config.toml in the ConfigMap");
    toml::from_str(text).unwrap_or_else(|error| panic!("config.toml is not TOML: {error}\n{text}"))
}

fn sandbox_template(rendered: &[Value]) -> Value {
    let text = config_map(rendered, "standby-sandbox-template")["data"]["sandbox-pod.yaml"]
        .as_str()
        .expect("sandbox-pod.yaml in the ConfigMap");
    serde_saphyr::from_str(text).unwrap_or_else(|error| panic!("sandbox-pod.yaml is not YAML: {error}\n{text}"))
}

/// The volume of the server container's mount holding `path`, and the
/// path inside that volume.
fn volume_of<'a>(rendered: &'a [Value], container: &'a Value, path: &str) -> (&'a Value, String) {
    let mount = container["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|mount| mount["mountPath"].as_str().is_some_and(|dir| path.starts_with(&format!("{dir}/"))))
        .max_by_key(|mount| mount["mountPath"].as_str().map_or(0, str::len))
        .unwrap_or_else(|| panic!("no mount of {} holds {path}", container["name"]));
    let inside = path[mount["mountPath"].as_str().expect("mountPath").len() + 1..].to_owned();
    let volume = server_pod(rendered)["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|volume| volume["name"] == mount["name"])
        .unwrap_or_else(|| panic!("no volume {} for {path}", mount["name"]));
    (volume, inside)
}

/// The Secret key a file at `path` of the server container comes from:
/// a Secret volume's item, or (as deployment.yaml does for the keys) a
/// memory-backed emptyDir an init container fills with `install -m 0600`
/// from a Secret volume's item of the same name.
fn secret_key_of(rendered: &[Value], path: &str) -> (String, String) {
    let (volume, inside) = volume_of(rendered, server_container(rendered), path);
    let from_secret = |volume: &Value, inside: &str| -> (String, String) {
        let secret = &volume["secret"];
        let name =
            secret["secretName"].as_str().unwrap_or_else(|| panic!("{path}: not from a Secret volume: {volume}"));
        let key = secret["items"]
            .as_array()
            .and_then(|items| items.iter().find(|item| item["path"] == inside))
            .map_or(inside, |item| item["key"].as_str().expect("an item's key"));
        (name.to_owned(), key.to_owned())
    };
    if volume.get("secret").is_some() {
        return from_secret(volume, &inside);
    }
    assert_eq!(volume["emptyDir"]["medium"], "Memory", "{path}: neither a Secret nor a memory emptyDir: {volume}");
    let copier = server_pod(rendered)["initContainers"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|init| strings(&init["command"]).iter().any(|arg| arg.ends_with(&format!("/{inside}"))))
        .unwrap_or_else(|| panic!("{path}: no init container copies {inside} into its emptyDir"));
    let command = strings(&copier["command"]);
    assert_eq!(command[..3], ["install", "-m", "0600"], "the copy is the server's alone: {command:?}");
    let source = command.iter().find(|arg| arg.ends_with(&format!("/{inside}"))).expect("the source");
    let (source_volume, source_inside) = volume_of(rendered, copier, source);
    from_secret(source_volume, &source_inside)
}

fn pod_selector_matches(selector: &Value, labels: &Value) -> bool {
    selector["matchLabels"].as_object().is_some_and(|wanted| wanted.iter().all(|(key, value)| labels[key] == *value))
}

fn ports(rule: &Value) -> BTreeSet<(i64, String)> {
    rule["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|port| {
            (port["port"].as_i64().expect("a numbered port"), port["protocol"].as_str().unwrap_or("TCP").to_owned())
        })
        .collect()
}

#[test]
fn the_base_renders_every_object_of_the_deployment_in_its_namespace() {
    let Some(rendered) = rendered("the_base_renders_every_object_of_the_deployment_in_its_namespace") else { return };
    let kinds: BTreeSet<String> =
        rendered.iter().map(|object| object["kind"].as_str().expect("kind").to_owned()).collect();
    let expected: BTreeSet<String> =
        ["Namespace", "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "Deployment", "NetworkPolicy"]
            .map(str::to_owned)
            .into();
    assert_eq!(kinds, expected, "{:?}", kustomize::names(&rendered));
    assert!(objects(&rendered, "Secret").is_empty(), "no Secret is committed: they are made by hand");
    for object in &rendered {
        if object["kind"] != "Namespace" {
            assert_eq!(object["metadata"]["namespace"], NAMESPACE, "{}", object["metadata"]);
        }
        assert_eq!(object["metadata"]["labels"]["app.kubernetes.io/part-of"], "standby", "{}", object["metadata"]);
    }

    let service = object(&rendered, "Service", SERVICE);
    assert_eq!(service["spec"]["type"], "ClusterIP");
    assert_eq!(service["spec"]["ports"][0]["port"], PORT);
    let pod_labels = &object(&rendered, "Deployment", DEPLOYMENT)["spec"]["template"]["metadata"]["labels"];
    assert!(pod_selector_matches(&serde_json::json!({"matchLabels": service["spec"]["selector"]}), pod_labels));
    let port = server_container(&rendered)["ports"]
        .as_array()
        .and_then(|ports| ports.iter().find(|port| port["name"] == service["spec"]["ports"][0]["targetPort"]))
        .expect("the Service's target port is the container's");
    assert_eq!(port["containerPort"], PORT);
}

#[test]
fn the_server_runs_replicated_locked_down_with_probes_on_healthz() {
    let Some(rendered) = rendered("the_server_runs_replicated_locked_down_with_probes_on_healthz") else { return };
    let deployment = object(&rendered, "Deployment", DEPLOYMENT);
    assert!(deployment["spec"]["replicas"].as_i64().is_some_and(|n| n >= 2), "replicated: {}", deployment["spec"]);
    let pod = server_pod(&rendered);
    let container = server_container(&rendered);
    assert_eq!(strings(&container["args"]), ["serve", "--config", "/etc/standby/config.toml"]);
    assert!(container["image"].as_str().is_some_and(|image| image.starts_with("standby-server")));
    for probe in ["readinessProbe", "livenessProbe"] {
        let get = &container[probe]["httpGet"];
        assert_eq!(get["path"], "/healthz", "{probe}");
        assert!(get["port"] == "http" || get["port"] == PORT, "{probe} on the HTTP port: {get}");
    }
    assert!(container["resources"]["requests"].is_object() && container["resources"]["limits"]["memory"].is_string());

    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert!(pod["securityContext"]["runAsUser"].as_i64().is_some_and(|uid| uid > 0));
    assert_eq!(pod["securityContext"]["seccompProfile"]["type"], "RuntimeDefault");
    let mut every = vec![container];
    every.extend(pod["initContainers"].as_array().into_iter().flatten());
    for each in every {
        let context = &each["securityContext"];
        assert_eq!(context["allowPrivilegeEscalation"], false, "{}", each["name"]);
        assert_eq!(context["readOnlyRootFilesystem"], true, "{}", each["name"]);
        assert_ne!(context["privileged"], true, "{}", each["name"]);
        assert_eq!(strings(&context["capabilities"]["drop"]), ["ALL"], "{}", each["name"]);
        assert!(context["capabilities"]["add"].is_null(), "{}", each["name"]);
    }

    assert_eq!(pod["serviceAccountName"], SERVICE_ACCOUNT);
    let anti =
        &pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"];
    assert_eq!(anti["topologyKey"], "kubernetes.io/hostname");
    assert!(pod_selector_matches(&anti["labelSelector"], &deployment["spec"]["template"]["metadata"]["labels"]));
    // A replica's stop: its engine, then at most 5 s for the last calls.
    assert!(pod["terminationGracePeriodSeconds"].as_i64().is_some_and(|seconds| seconds >= 15));

    // listen = 0.0.0.0 names no address the other replicas can dial: each
    // advertises its own.
    let env = container["env"].as_array().expect("env");
    let advertise = env.iter().find(|var| var["name"] == "STANDBY_SERVER_ADVERTISE_URL").expect("an advertised URL");
    assert_eq!(advertise["value"], format!("http://$(POD_IP):{PORT}"));
    let pod_ip = env.iter().position(|var| var["name"] == "POD_IP").expect("POD_IP");
    assert_eq!(env[pod_ip]["valueFrom"]["fieldRef"]["fieldPath"], "status.podIP");
    assert!(
        pod_ip < env.iter().position(|var| var == advertise).expect("its place"),
        "$(POD_IP) is defined before its use"
    );

    // The data directory is writable: an emptyDir, under the read-only root.
    let config = config(&rendered);
    let data_dir = config["data_dir"].as_str().expect("data_dir");
    let (volume, _) = volume_of(&rendered, container, data_dir);
    assert!(volume["emptyDir"].is_object(), "data_dir on an emptyDir: {volume}");
}

#[test]
fn the_store_url_comes_only_from_a_secret() {
    let Some(rendered) = rendered("the_store_url_comes_only_from_a_secret") else { return };
    let container = server_container(&rendered);
    let store: Vec<&Value> =
        container["env"].as_array().into_iter().flatten().filter(|var| var["name"] == "STANDBY_SERVER_STORE").collect();
    assert_eq!(store.len(), 1);
    assert!(store[0]["value"].is_null(), "never a literal");
    assert_eq!(store[0]["valueFrom"]["secretKeyRef"]["name"], "standby-store");
    assert!(container["envFrom"].is_null());
    assert!(!config(&rendered).contains_key("store"), "the file holds no store URL");
    let text = serde_json::to_string(&rendered).expect("JSON");
    assert!(!text.contains("postgres://") && !text.contains("postgresql://"), "no store URL anywhere");
}

#[test]
fn the_keys_are_files_from_the_secret_at_the_paths_the_config_names() {
    let Some(rendered) = rendered("the_keys_are_files_from_the_secret_at_the_paths_the_config_names") else { return };
    let config = config(&rendered);
    let paths = [
        (config["api_key_file"].as_str(), "api-key"),
        (config["secret_key_file"].as_str(), "secret-key"),
        (config["replica"]["cluster_secret_file"].as_str(), "cluster-secret"),
    ];
    for (path, key) in paths {
        let path = path.unwrap_or_else(|| panic!("config.toml names the file of {key}"));
        assert_eq!(secret_key_of(&rendered, path), ("standby-keys".to_owned(), key.to_owned()), "{path}");
    }
    assert!(!config.contains_key("api_key"), "the key itself is never in the file");
    // The Secret volume (0400) is the init container's alone: the server's
    // container reads the copies it owns.
    let container = server_container(&rendered);
    let secret_volumes: Vec<&str> = server_pod(&rendered)["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|volume| volume.get("secret").is_some())
        .map(|volume| volume["name"].as_str().expect("a name"))
        .collect();
    assert!(!secret_volumes.is_empty());
    for mount in container["volumeMounts"].as_array().into_iter().flatten() {
        assert!(!secret_volumes.contains(&mount["name"].as_str().expect("a name")), "{mount}");
    }
}

#[test]
fn the_configuration_file_is_for_the_kubernetes_provider_on_the_service() {
    let Some(rendered) = rendered("the_configuration_file_is_for_the_kubernetes_provider_on_the_service") else {
        return;
    };
    let config = config(&rendered);
    // Every key of it is one the server knows: the control plane's own
    // parser reads this file in its tests
    // (config::tests::the_kubernetes_deployments_configuration_file_holds_only_keys_the_server_knows).
    assert_eq!(config["provider"].as_str(), Some("kubernetes"));
    assert_eq!(config["listen"].as_str(), Some("0.0.0.0:8080"));
    assert_eq!(config["public_url"].as_str(), Some(format!("http://{SERVICE}.{NAMESPACE}.svc:{PORT}").as_str()));
    let kubernetes = config["kubernetes"].as_table().expect("[kubernetes]");
    assert!(
        kubernetes["kubernetes_instance"].as_str().is_some_and(|id| !id.is_empty()),
        "one instance for every replica"
    );
    assert!(kubernetes.get("kubernetes_namespace").is_none(), "the server's own namespace, which the Role is in");
    let template = kubernetes["kubernetes_pod_template"].as_str().expect("kubernetes_pod_template");
    let (volume, key) = volume_of(&rendered, server_container(&rendered), template);
    let map = volume["configMap"]["name"].as_str().expect("the template from a ConfigMap");
    assert!(map.starts_with("standby-sandbox-template-"), "{map}");
    assert_eq!(key, "sandbox-pod.yaml");
    assert!(config["replica"]["lease_ttl"].is_str());
}

#[test]
fn the_sandbox_pod_template_holds_nothing_secret_and_is_locked_down() {
    let Some(rendered) = rendered("the_sandbox_pod_template_holds_nothing_secret_and_is_locked_down") else { return };
    let template = sandbox_template(&rendered);
    assert_eq!(template["metadata"]["labels"][SANDBOX_LABEL.0], SANDBOX_LABEL.1);
    let spec = &template["spec"];
    let containers = spec["containers"].as_array().expect("containers");
    assert_eq!(containers.len(), 1, "one container");
    let container = &containers[0];
    assert!(container["image"].as_str().is_some_and(|image| image.starts_with("standby-sandbox")));

    let text = serde_json::to_string(&template).expect("JSON");
    for secret in ["secretKeyRef", "secretRef", "\"secret\"", "projected", "serviceAccountToken", "STANDBY_TOKEN"] {
        assert!(!text.contains(secret), "the sandbox template mentions {secret}: {text}");
    }
    for var in container["env"].as_array().into_iter().flatten() {
        assert!(var["valueFrom"].is_null(), "no env from anywhere: {var}");
    }
    assert!(container["envFrom"].is_null() && spec["volumes"].is_null(), "no volume but the server's workspace");
    assert!(spec["serviceAccountName"].is_null());
    assert_eq!(spec["automountServiceAccountToken"], false);
    assert_eq!(spec["enableServiceLinks"], false);
    for host in ["hostNetwork", "hostPID", "hostIPC"] {
        assert_ne!(spec[host], true, "{host}");
    }

    assert_eq!(spec["securityContext"]["runAsNonRoot"], true);
    assert_eq!(spec["securityContext"]["seccompProfile"]["type"], "RuntimeDefault");
    let context = &container["securityContext"];
    assert_eq!(context["allowPrivilegeEscalation"], false);
    assert_eq!(context["privileged"], false);
    assert_eq!(strings(&context["capabilities"]["drop"]), ["ALL"]);
    assert!(context["capabilities"]["add"].is_null());
    assert_ne!(context["runAsNonRoot"], false);
    assert_ne!(context["seccompProfile"]["type"], "Unconfined");

    // STANDBY_CANCEL_GRACE (10 s) + 20 s.
    assert_eq!(spec["terminationGracePeriodSeconds"], 30);
    assert!(
        container["resources"]["requests"]["cpu"].is_string() && container["resources"]["limits"]["memory"].is_string()
    );
}

#[test]
fn the_network_policies_let_sandboxes_reach_only_the_server_dns_and_the_internet() {
    let Some(rendered) = rendered("the_network_policies_let_sandboxes_reach_only_the_server_dns_and_the_internet")
    else {
        return;
    };
    let server_labels = &object(&rendered, "Deployment", DEPLOYMENT)["spec"]["template"]["metadata"]["labels"];
    let sandbox_labels = serde_json::json!({ SANDBOX_LABEL.0: SANDBOX_LABEL.1 });
    let dns: BTreeSet<(i64, String)> = [(53, "UDP".to_owned()), (53, "TCP".to_owned())].into();
    let http: BTreeSet<(i64, String)> = [(PORT, "TCP".to_owned())].into();

    let sandbox = &object(&rendered, "NetworkPolicy", "standby-sandbox")["spec"];
    assert!(pod_selector_matches(&sandbox["podSelector"], &sandbox_labels));
    assert!(!pod_selector_matches(&sandbox["podSelector"], server_labels));
    assert_eq!(strings(&sandbox["policyTypes"]), ["Ingress", "Egress"]);
    assert!(sandbox["ingress"].as_array().is_some_and(Vec::is_empty), "nothing connects to a sandbox");
    let egress = sandbox["egress"].as_array().expect("egress");
    assert_eq!(egress.len(), 3, "DNS, the server, the internet: {egress:?}");
    assert_eq!(ports(&egress[0]), dns);
    assert_eq!(egress[0]["to"][0]["podSelector"]["matchLabels"]["k8s-app"], "kube-dns");
    assert_eq!(ports(&egress[1]), http);
    assert!(pod_selector_matches(&egress[1]["to"][0]["podSelector"], server_labels));
    assert!(egress[1]["to"][0]["namespaceSelector"].is_null(), "the server's pods in this namespace only");
    assert!(ports(&egress[2]).is_empty(), "any port on the internet");
    let blocks = egress[2]["to"].as_array().expect("to");
    let v4 = blocks.iter().find(|to| to["ipBlock"]["cidr"] == "0.0.0.0/0").expect("IPv4 internet");
    assert_eq!(strings(&v4["ipBlock"]["except"]), PRIVATE_RANGES);
    for block in blocks {
        let cidr = block["ipBlock"]["cidr"].as_str().expect("only address blocks");
        assert!(!strings(&block["ipBlock"]["except"]).is_empty(), "{cidr} excepts the private ranges");
    }

    let server = &object(&rendered, "NetworkPolicy", "standby-server")["spec"];
    assert!(pod_selector_matches(&server["podSelector"], server_labels));
    assert!(!pod_selector_matches(&server["podSelector"], &sandbox_labels));
    assert_eq!(strings(&server["policyTypes"]), ["Ingress", "Egress"]);
    let ingress = server["ingress"].as_array().expect("ingress");
    let from_sandboxes = ingress
        .iter()
        .find(|rule| pod_selector_matches(&rule["from"][0]["podSelector"], &sandbox_labels))
        .expect("agents reach the server");
    assert_eq!(ports(from_sandboxes), http);
    let from_replicas = ingress
        .iter()
        .find(|rule| pod_selector_matches(&rule["from"][0]["podSelector"], server_labels))
        .expect("replicas reach each other");
    assert_eq!(ports(from_replicas), http);
    let egress = server["egress"].as_array().expect("egress");
    let reached: BTreeSet<i64> = egress.iter().flat_map(ports).map(|(port, _)| port).collect();
    assert_eq!(reached, [53, 443, 5432, 6443, PORT].into(), "DNS, the API server, PostgreSQL, the replicas");
    let to_replicas = egress.iter().find(|rule| ports(rule) == http).expect("to the replicas");
    assert!(pod_selector_matches(&to_replicas["to"][0]["podSelector"], server_labels));

    // Callers: every namespace, on the HTTP port only.
    let users = &object(&rendered, "NetworkPolicy", "standby-server-users")["spec"];
    assert!(pod_selector_matches(&users["podSelector"], server_labels));
    assert_eq!(strings(&users["policyTypes"]), ["Ingress"]);
    assert_eq!(users["ingress"][0]["from"][0]["namespaceSelector"], serde_json::json!({}));
    assert_eq!(ports(&users["ingress"][0]), http);
}

#[test]
fn the_role_is_of_the_namespace_alone_and_bound_to_the_servers_account() {
    let Some(rendered) = rendered("the_role_is_of_the_namespace_alone_and_bound_to_the_servers_account") else {
        return;
    };
    // Its rules are the provider's calls, compared on every path by
    // kubernetes_provider::the_providers_calls_on_each_path_are_exactly_what_the_role_grants.
    assert!(!role_grants(&rendered).is_empty());
    assert!(objects(&rendered, "ClusterRole").is_empty() && objects(&rendered, "ClusterRoleBinding").is_empty());
    let binding = object(&rendered, "RoleBinding", "standby-server");
    assert_eq!(binding["roleRef"]["kind"], "Role");
    assert_eq!(binding["roleRef"]["name"], "standby-server");
    assert_eq!(
        binding["subjects"],
        serde_json::json!([{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": NAMESPACE}])
    );
    // The token is the server pod's alone: the account mounts none by default.
    assert_eq!(object(&rendered, "ServiceAccount", SERVICE_ACCOUNT)["automountServiceAccountToken"], false);
    assert_eq!(server_pod(&rendered)["automountServiceAccountToken"], true);
}

#[test]
fn the_agent_sandbox_overlay_changes_its_role_and_its_mode_only() {
    let Some(base) = rendered("the_agent_sandbox_overlay_changes_its_role_and_its_mode_only") else { return };
    let overlay =
        kustomize::render(&deploy_dir().join("overlays/agent-sandbox")).unwrap_or_else(|error| panic!("{error}"));
    // Its rules are agent-sandbox mode's calls, compared on every path by
    // kubernetes_agent_sandbox::the_calls_of_agent_sandbox_mode_are_exactly_what_its_role_grants.
    let grants = role_grants(&overlay);
    assert!(grants.contains(&grant("extensions.agents.x-k8s.io", "sandboxclaims", "create")), "{grants:?}");
    assert!(!grants.contains(&grant("", "pods", "create")), "agent-sandbox's controller makes the Pods: {grants:?}");

    let mode: Vec<&Value> = server_container(&overlay)["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|var| var["name"] == "STANDBY_SERVER_KUBERNETES_API")
        .collect();
    assert_eq!(mode.len(), 1);
    assert_eq!(mode[0]["value"], "agent-sandbox");

    // Everything else is the base's.
    let others = |rendered: &[Value]| -> Vec<Value> {
        rendered.iter().filter(|object| object["kind"] != "Role" && object["kind"] != "Deployment").cloned().collect()
    };
    assert_eq!(others(&overlay), others(&base));
}
