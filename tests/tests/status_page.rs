//! The status page in a real browser: headless Chromium (through
//! chromedriver) against a live `standby-server` whose runs are in every
//! state a test can hold them in (exited, failed, cancelled, running,
//! waiting) and whose sandboxes are standby, assigned, parked and retired.
//! It signs in (a wrong key first, refused), checks that the page shows
//! what the API says and updates without a reload, follows a run's log
//! link, submits a run whose command is markup and script and checks that
//! the page shows it as text and runs none of it, signs out, and checks
//! that the key never was in a URL the browser loaded. It saves a
//! screenshot (`STANDBY_BLESS=1` writes it to `docs/status-page.png`).
//!
//! Needs Debian's `chromium` and `chromium-driver` (under `CI=true` a
//! missing one fails the test, elsewhere it is skipped, loudly), and both
//! binaries of the workspace built (`cargo build --bins`).

use std::collections::BTreeMap;
use std::hash::{BuildHasher, RandomState};
use std::time::{Duration, Instant};

use fantoccini::Locator;
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use standby_e2e::browser::{Browser, tools};
use standby_e2e::harness::write_json;
use standby_e2e::postgres::TestSchema;
use standby_e2e::prometheus::repo_root;
use standby_e2e::server_process::{API_KEY, ServerBuilder, ServerProcess, free_addr, keygen};

const WAIT: Duration = Duration::from_secs(60);

/// A command a user could submit that a careless page would run: a script
/// and an image whose error handler runs one. The page must show it as
/// text and run neither (each would set `window.__pwned`).
const HOSTILE: &str = r#"<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">"#;

/// What the page shows, read from its DOM.
const READ_PAGE: &str = r#"
const rows = [...document.querySelectorAll('#runs tr')];
return {
  loaded: document.body.dataset.loaded || null,
  runs: rows.map((tr) => [tr.dataset.runId, tr.dataset.state]),
  commands: Object.fromEntries(rows.map((tr) => [tr.dataset.runId, tr.querySelector('td.command').textContent])),
  states: Object.fromEntries([...document.querySelectorAll('#run-states .chip')]
    .map((chip) => [chip.dataset.state, Number(chip.dataset.count)])),
  pool: Object.fromEntries([...document.querySelectorAll('#pool .tile')]
    .map((tile) => [tile.dataset.key, tile.querySelector('.count').textContent])),
  sandboxes: [...document.querySelectorAll('#sandboxes tr')].map((tr) => [tr.dataset.sandboxId, tr.dataset.state]),
};
"#;

/// What the page should show, read from the API.
async fn expected(server: &ServerProcess) -> Value {
    let mut runs = server.runs().await;
    runs.reverse();
    let mut states: BTreeMap<String, u64> = [
        "queued",
        "waiting",
        "resuming",
        "committed",
        "confirmed",
        "running",
        "cancelling",
        "exited",
        "failed",
        "cancelled",
    ]
    .into_iter()
    .map(|state| (state.to_owned(), 0))
    .collect();
    for run in &runs {
        *states.entry(run["state"].as_str().unwrap_or_default().to_owned()).or_default() += 1;
    }
    let sandboxes = server.sandboxes().await;
    let count = |check: &dyn Fn(&Value) -> bool| sandboxes.iter().filter(|s| check(s)).count().to_string();
    json!({
        "runs": runs.iter().take(100).map(|run| json!([run["id"], run["state"]])).collect::<Vec<_>>(),
        "states": states,
        "pool": {
            "parked_running": count(&|s| s["state"] == "parked" && s["park"]["mode"] == "running"),
            "parked_stopped": count(&|s| s["state"] == "parked" && s["park"]["mode"] == "stopped"),
            "resuming": count(&|s| s["state"] == "resuming"),
            "retired": count(&|s| s["state"] == "retired"),
        },
        "sandboxes": sandboxes.iter().take(50).map(|s| json!([s["id"], s["state"]])).collect::<Vec<_>>(),
    })
}

/// Whether the page shows what the API says.
fn agrees(page: &Value, api: &Value) -> bool {
    page["loaded"].is_string()
        && page["runs"] == api["runs"]
        && page["states"] == api["states"]
        && page["sandboxes"] == api["sandboxes"]
        && ["parked_running", "parked_stopped", "resuming", "retired"]
            .iter()
            .all(|key| page["pool"][key] == api["pool"][key])
}

/// Waits until the page and the API agree (the page polls every few
/// seconds; a run may change state between two reads): the page.
async fn page_agrees_with_api(browser: &Browser, server: &ServerProcess) -> Value {
    let mut last = (Value::Null, Value::Null);
    let deadline = Instant::now() + WAIT;
    loop {
        let api = expected(server).await;
        let page = browser.eval(READ_PAGE).await;
        if agrees(&page, &api) {
            return page;
        }
        assert!(
            Instant::now() < deadline,
            "the page never showed what the API says:\npage {:#}\napi {:#}",
            last.0,
            last.1
        );
        last = (page, api);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Every URL the browser loaded for the current document: its address
/// and every resource it fetched (`performance.getEntries()`).
async fn loaded_urls(browser: &Browser) -> Vec<String> {
    let names = browser.eval("return [location.href, ...performance.getEntries().map((entry) => entry.name)];").await;
    names.as_array().into_iter().flatten().filter_map(|name| name.as_str().map(str::to_owned)).collect()
}

async fn click(browser: &Browser, css: &str) {
    let element = browser.client.find(Locator::Css(css)).await.unwrap_or_else(|error| panic!("{css}: {error}"));
    element.click().await.unwrap_or_else(|error| panic!("click {css}: {error}"));
}

async fn type_key(browser: &Browser, key: &str) {
    let input = browser.client.find(Locator::Css("#key")).await.expect("the key's field");
    input.clear().await.expect("clear the field");
    input.send_keys(key).await.expect("type the key");
}

async fn at(browser: &Browser, url: &str) {
    browser.until(&format!("the browser at {url}"), async || (browser.url().await == url).then_some(())).await;
}

async fn session_cookie(browser: &Browser) -> Option<String> {
    let cookies = browser.client.get_all_cookies().await.expect("the cookies");
    cookies.iter().find(|cookie| cookie.name() == "standby_session").map(|cookie| {
        let same_site = cookie.same_site().map(|s| format!("{s:?}")).unwrap_or_default();
        format!("{}|{:?}|{}|{}", cookie.path().unwrap_or_default(), cookie.http_only(), same_site, cookie.value())
    })
}

/// The running cap the test's server is given.
const CAP: usize = 3;

/// Submits `sleep` runs until the cap is all running runs and one more
/// waits for a slot (a parked sandbox is stopped, and a standby is not
/// replaced, to make room first): the one that waits.
async fn fill_to_the_cap(server: &ServerProcess) -> String {
    for _ in 0..8 {
        let id = server.submit(&json!({"command": ["sleep", "600"]})).await;
        let waits = server
            .until("the run to run, or to wait with the cap full", WAIT, async || {
                let runs = server.runs().await;
                let running = runs.iter().filter(|run| run["state"] == "running").count();
                let run = runs.iter().find(|run| run["id"] == id.as_str())?;
                match run["state"].as_str() {
                    Some("running") => Some(false),
                    Some("waiting") if running >= CAP => Some(true),
                    _ => None,
                }
            })
            .await;
        if waits {
            return id;
        }
    }
    panic!("no run waited under a running cap of {CAP}\n{}", server.logs());
}

#[tokio::test]
async fn the_status_page_shows_what_the_api_says_as_text_and_never_puts_the_key_in_a_url() {
    let test = "the_status_page_in_a_real_browser";
    let Some((chromium, chromedriver)) = tools(test) else { return };
    let dir = tempfile::Builder::new().prefix("standby-status-page-").tempdir().expect("a temp dir");
    let spec_path = dir.path().join("spec.json");
    write_json(&spec_path, &json!({"workspace": {"repos": [], "setup": []}, "shell": ["/bin/sh"]}));
    let mark = format!("{:016x}", RandomState::new().hash_one((std::process::id(), dir.path())));
    let server = ServerBuilder::new(&dir.path().join("data"), &dir.path().join("server.log"), &mark)
        .args(&["--spec", &spec_path.display().to_string(), "--pool-size", "1", "--running-cap", &CAP.to_string()])
        .args(&["--heartbeat-interval", "200ms", "--linger", "2s", "--stop-grace", "3s"])
        .start()
        .await;

    // Runs in every state the test can hold: exited, failed (its cwd is
    // not in the workspace), a thread's turn (its sandbox parked), running
    // until the cap is reached, one waiting for a slot, one cancelled.
    server
        .until("a ready standby", WAIT, async || {
            server.sandboxes().await.into_iter().any(|sandbox| sandbox["candidate"] == true).then_some(())
        })
        .await;
    let hello = server.submit(&json!({"command": ["sh", "-c", "echo hello from the status page"]})).await;
    assert_eq!(server.finished(&hello, WAIT).await["state"], "exited");
    let failed = server.submit(&json!({"command": ["true"], "cwd": "no-such-dir"})).await;
    assert_eq!(server.finished(&failed, WAIT).await["state"], "failed");
    let turn = server.submit(&json!({"command": ["true"], "thread_id": "thread-1"})).await;
    assert_eq!(server.finished(&turn, WAIT).await["state"], "exited");
    let waiting = fill_to_the_cap(&server).await;
    let cancelled = server.submit(&json!({"command": ["sleep", "600"]})).await;
    let (status, _) =
        server.call(reqwest::Method::POST, &format!("/v1/runs/{cancelled}/cancel"), Some(API_KEY), None).await;
    assert_eq!(status, 200);
    assert_eq!(server.finished(&cancelled, WAIT).await["state"], "cancelled");

    let started = Instant::now();
    let browser = Browser::start(&chromium, &chromedriver, dir.path()).await;
    let base = server.url();
    let mut urls = Vec::new();

    // No session: the page sends the browser to the sign-in form.
    browser.client.goto(&format!("{base}/ui")).await.expect("open the page");
    at(&browser, &format!("{base}/ui/sign-in")).await;
    urls.extend(loaded_urls(&browser).await);

    // A wrong key is refused, saying only that.
    type_key(&browser, "not-the-key").await;
    click(&browser, "#sign-in").await;
    browser
        .until("the refusal", async || {
            let shown = browser.eval("const p = document.getElementById('failed'); return p && !p.hidden;").await;
            (shown == true).then_some(())
        })
        .await;
    let refusal = browser.eval("return document.getElementById('failed').textContent").await;
    assert_eq!(refusal, "Sign-in failed.");
    assert_eq!(browser.url().await, format!("{base}/ui/sign-in"));
    assert_eq!(session_cookie(&browser).await, None, "no session for a wrong key");
    urls.extend(loaded_urls(&browser).await);
    let refused = browser.client.screenshot().await.expect("a screenshot");
    let kept = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("status-page-refused.png");
    std::fs::write(&kept, refused).unwrap_or_else(|error| panic!("write {}: {error}", kept.display()));

    // The key: a session cookie only the page's requests carry.
    type_key(&browser, API_KEY).await;
    click(&browser, "#sign-in").await;
    at(&browser, &format!("{base}/ui")).await;
    let cookie = session_cookie(&browser).await.expect("a session cookie");
    assert!(cookie.starts_with("/ui|Some(true)|Strict|"), "{cookie}");
    assert!(!cookie.contains(API_KEY), "the cookie is not the key");

    // What the page shows is what the API says.
    let page = page_agrees_with_api(&browser, &server).await;
    for state in ["exited", "failed", "cancelled", "running", "waiting"] {
        assert!(page["states"][state].as_u64() > Some(0), "no {state} run on the page: {page:#}");
    }
    let parked = ["parked_running", "parked_stopped"].map(|key| page["pool"][key].as_str().unwrap_or("0") != "0");
    assert!(parked.contains(&true), "the thread's sandbox is parked: {page:#}");
    // The agent's own timing of a warm start (contract 1.3, install_us),
    // drawn under the waterfall once opened.
    let steps = format!("#runs details.steps[data-run-id=\"{hello}\"]");
    click(&browser, &format!("{steps} summary")).await;
    let drawn = browser
        .eval(&format!("return [...document.querySelectorAll('{steps} .step')].map((row) => row.dataset.step)"))
        .await;
    let drawn: Vec<String> = serde_json::from_value(drawn).expect("step names");
    for step in ["confirm", "secrets", "spawn", "critical_path"] {
        assert!(drawn.iter().any(|name| name == step), "{step} is not drawn: {drawn:?}");
    }
    assert_eq!(drawn.last().map(String::as_str), Some("critical_path"), "{drawn:?}");
    urls.extend(loaded_urls(&browser).await);
    let screenshot = browser.client.screenshot().await.expect("a screenshot");
    save_screenshot(&screenshot);

    // It updates in place: a change shows without a reload.
    browser.eval("window.__sameDocument = true;").await;
    let (status, _) =
        server.call(reqwest::Method::POST, &format!("/v1/runs/{waiting}/cancel"), Some(API_KEY), None).await;
    assert_eq!(status, 200);
    browser
        .until("the cancelled run on the page", async || {
            let state = browser
                .eval(&format!("return document.querySelector('#runs tr[data-run-id=\"{waiting}\"]').dataset.state"))
                .await;
            (state == "cancelled").then_some(())
        })
        .await;
    assert_eq!(browser.eval("return window.__sameDocument === true").await, true, "no reload");
    page_agrees_with_api(&browser, &server).await;

    // A run's command is a user's input: shown as text, never run.
    let hostile = server.submit(&json!({"command": ["sh", "-c", HOSTILE], "thread_id": "x.y:z-1"})).await;
    let shown = browser
        .until("the hostile run on the page", async || {
            let page = browser.eval(READ_PAGE).await;
            page["commands"][&hostile].as_str().map(str::to_owned)
        })
        .await;
    assert_eq!(shown, format!("sh -c {HOSTILE}"), "the command as text");
    let ran = browser
        .eval("return [typeof window.__pwned, document.querySelectorAll('#runs img, #runs script').length]")
        .await;
    assert_eq!(ran, json!(["undefined", 0]), "nothing of it ran or became an element");
    page_agrees_with_api(&browser, &server).await;

    // The log link.
    let href = browser
        .client
        .find(Locator::Css(&format!("#runs tr[data-run-id=\"{hello}\"] a")))
        .await
        .expect("the run's row")
        .attr("href")
        .await
        .expect("its link")
        .expect("an href");
    assert_eq!(href, format!("/ui/runs/{hello}/log"));
    browser.client.goto(&format!("{base}{href}")).await.expect("open the log");
    let log = browser.eval("return document.body.innerText").await;
    assert!(log.as_str().is_some_and(|text| text.contains("hello from the status page")), "{log}");
    urls.extend(loaded_urls(&browser).await);
    browser.client.back().await.expect("back to the page");
    at(&browser, &format!("{base}/ui")).await;
    page_agrees_with_api(&browser, &server).await;
    urls.extend(loaded_urls(&browser).await);

    // Sign-out ends the session: the page sends to sign-in again.
    click(&browser, "#sign-out").await;
    at(&browser, &format!("{base}/ui/sign-in")).await;
    assert_eq!(session_cookie(&browser).await, None, "the cookie is gone");
    browser.client.goto(&format!("{base}/ui")).await.expect("open the page");
    at(&browser, &format!("{base}/ui/sign-in")).await;
    urls.extend(loaded_urls(&browser).await);
    let history = browser.eval("return history.length").await;

    // The key was never in a URL (the form posts it), nor in the log.
    assert!(urls.len() > 10, "{urls:?}");
    for url in &urls {
        assert!(!url.contains(API_KEY), "the key in a URL: {url}");
    }
    assert!(history.as_u64() > Some(3), "{history}");
    let took = started.elapsed();
    browser.close().await;
    eprintln!("{test}: the browser's part took {took:?}");
    let log = std::fs::read_to_string(server.log_path()).unwrap_or_default();
    assert!(!log.contains(API_KEY), "the key in the server's log");
    server.stop_leaving_nothing(Signal::SIGTERM).await;
}

/// In a replicated deployment a follower forwards `/ui` to the leader,
/// which holds the sessions: signing in through a follower opens the page
/// through either, and the page's replicas panel is `GET /v1/cluster` as
/// the leader answers it (every replica, the leader, its epoch). Plain
/// HTTP: the browser's part is the same page. Needs PostgreSQL
/// (`STANDBY_TEST_POSTGRES`, `scripts/postgres`; skipped loudly without it
/// outside CI).
#[tokio::test]
async fn through_a_follower_the_page_signs_in_at_the_leader_and_shows_the_replicas_and_epoch() {
    let Some(schema) = TestSchema::create("status_page::replicated") else { return };
    let dir = tempfile::Builder::new().prefix("standby-status-replicas-").tempdir().expect("a temp dir");
    let spool = dir.path().join("spool");
    std::fs::create_dir_all(&spool).expect("the spool");
    let key = dir.path().join("secret.key");
    keygen(&key);
    let mut replicas = Vec::new();
    for index in 0..2 {
        let mark = format!("status-replicas-{}-{index}-{}", std::process::id(), schema.name());
        let data = dir.path().join(format!("data{index}"));
        let server = ServerBuilder::new(&data, &dir.path().join(format!("r{index}.log")), &mark)
            .args(&["--provider", "spool", "--spool-dir", &spool.display().to_string(), "--store", &schema.url()])
            .listen(free_addr())
            .args(&["--lease-ttl", "3s", "--replica-id", &format!("r{index}"), "--pool-size", "1"])
            .args(&["--secret-key-file", &key.display().to_string()])
            .cluster_secret(&dir.path().join("cluster.secret"))
            .start()
            .await;
        replicas.push(server);
    }
    // Both name the same leader, which says it leads.
    let (leader, epoch) = replicas[0]
        .until("the replicas to agree on a leader", WAIT, async || {
            let views = [replicas[0].get("/v1/cluster").await, replicas[1].get("/v1/cluster").await];
            let id = views[0]["leader"]["id"].as_str()?.to_owned();
            let index: usize = id.strip_prefix('r')?.parse().ok()?;
            let agreed = views[1]["leader"]["id"] == id.as_str() && views[index]["role"] == "leader";
            agreed.then(|| (index, views[index]["epoch"].as_u64().unwrap_or_default()))
        })
        .await;
    let follower = &replicas[1 - leader];
    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().expect("a client");
    let signed = http
        .post(format!("{}/ui/sign-in", follower.url()))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("key={API_KEY}"))
        .send()
        .await
        .expect("an answer");
    assert_eq!(signed.status().as_u16(), 303, "signed in through the follower");
    let cookie = signed.headers()["set-cookie"].to_str().expect("a cookie").split(';').next().expect("one").to_owned();
    for replica in [follower, &replicas[leader]] {
        let summary: Value = http
            .get(format!("{}/ui/api/summary", replica.url()))
            .header("cookie", &cookie)
            .send()
            .await
            .expect("an answer")
            .json()
            .await
            .expect("JSON");
        let cluster = &summary["cluster"];
        assert_eq!(cluster["leader"]["id"], format!("r{leader}"), "{summary:#}");
        assert_eq!((cluster["role"].as_str(), cluster["epoch"].as_u64()), (Some("leader"), Some(epoch)), "{summary:#}");
        let mut ids: Vec<&str> =
            cluster["replicas"].as_array().expect("replicas").iter().filter_map(|r| r["id"].as_str()).collect();
        ids.sort_unstable();
        assert_eq!(ids, ["r0", "r1"], "{summary:#}");
        assert_eq!(summary["pool"]["pool_target"], 1);
    }
    let page = http.get(format!("{}/ui", follower.url())).header("cookie", &cookie).send().await.expect("an answer");
    assert_eq!(page.status().as_u16(), 200);
    assert!(page.headers()["content-security-policy"].to_str().is_ok_and(|csp| csp.contains("script-src 'self'")));
    for replica in replicas {
        replica.stop_leaving_nothing(Signal::SIGTERM).await;
    }
}

/// Keeps the screenshot beside the test's build, and in `docs/` when
/// blessed (`STANDBY_BLESS=1`), as the OpenAPI document is.
fn save_screenshot(png: &[u8]) {
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    let kept = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("status-page.png");
    std::fs::write(&kept, png).unwrap_or_else(|error| panic!("write {}: {error}", kept.display()));
    eprintln!("the status page's screenshot: {}", kept.display());
    if std::env::var_os("STANDBY_BLESS").is_some_and(|bless| bless == "1") {
        let docs = repo_root().join("docs/status-page.png");
        std::fs::write(&docs, png).unwrap_or_else(|error| panic!("write {}: {error}", docs.display()));
    }
}
