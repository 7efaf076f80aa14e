//! A real browser for the status page's test: Debian's Chromium, headless,
//! driven through its `chromedriver` (W3C WebDriver) by fantoccini, on
//! loopback HTTP (no TLS stack in the client).
//!
//! chromedriver is started on a free port with a mark in its environment,
//! which Chromium and every process of it inherit ([`MARK`]): closing the
//! browser ends the session and then waits until no marked process is
//! left, and dropping it (a test that panicked) kills them all, so no
//! browser outlives its test.
//!
//! Needs Debian's `chromium` and `chromium-driver`: under `CI=true` a
//! missing one fails the test, elsewhere it is skipped, loudly.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use fantoccini::{Client, ClientBuilder};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};

use crate::harness::system_tool;
use crate::server_process::{MARK, ServerProcess, free_addr, marked, poll, tail};

/// Bound on chromedriver's start and on each wait of a test's page.
pub const WAIT: Duration = Duration::from_secs(30);

/// The browser's window: wide enough for the status page's tables.
const WINDOW: (u32, u32) = (1440, 1200);

/// Chromium and chromedriver, or `None` (after a loud line) when the
/// test is to be skipped; panics under `CI=true` instead.
pub fn tools(test: &str) -> Option<(PathBuf, PathBuf)> {
    let chromium = system_tool("chromium", "chromium", test);
    let driver = system_tool("chromedriver", "chromium-driver", test);
    chromium.zip(driver)
}

/// Kills what the browser left when dropped: chromedriver's process group
/// and every process carrying the mark.
#[derive(Debug)]
struct Reaper {
    driver: std::process::Child,
    mark: String,
    done: bool,
}

impl Reaper {
    fn kill_all(&mut self) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        if let Ok(pid) = i32::try_from(self.driver.id()) {
            let _ = nix::sys::signal::killpg(Pid::from_raw(pid), Signal::SIGKILL);
        }
        for pid in marked(&self.mark) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        let _ = self.driver.wait();
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// A headless Chromium session.
#[derive(Debug)]
pub struct Browser {
    pub client: Client,
    reaper: Reaper,
    log: PathBuf,
}

impl Browser {
    /// Starts chromedriver (its log and Chromium's profile in `dir`) and a
    /// session of headless Chromium.
    pub async fn start(chromium: &Path, chromedriver: &Path, dir: &Path) -> Self {
        use std::os::unix::process::CommandExt as _;
        let port = free_addr().port();
        let mark = format!("browser-{}-{port}", std::process::id());
        let log = dir.join("chromedriver.log");
        let driver = std::process::Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .arg(format!("--log-path={}", log.display()))
            .env(MARK, &mark)
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| panic!("start {}: {error}", chromedriver.display()));
        let reaper = Reaper { driver, mark, done: false };
        let url = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        poll(
            "chromedriver to be ready",
            WAIT,
            Duration::from_millis(100),
            async || {
                let status: Value = http.get(format!("{url}/status")).send().await.ok()?.json().await.ok()?;
                (status["value"]["ready"] == true).then_some(())
            },
            || tail(&log, 30),
        )
        .await;
        let profile = dir.join("chromium-profile");
        let options = json!({
            "binary": chromium,
            "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--disable-extensions", "--hide-scrollbars", "--force-device-scale-factor=1",
                format!("--window-size={},{}", WINDOW.0, WINDOW.1),
                format!("--user-data-dir={}", profile.display()),
            ],
        });
        let mut capabilities = serde_json::Map::new();
        capabilities.insert("goog:chromeOptions".into(), options);
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        let client = ClientBuilder::new(connector)
            .capabilities(capabilities)
            .connect(&url)
            .await
            .unwrap_or_else(|error| panic!("a Chromium session: {error}\n{}", tail(&log, 40)));
        Self { client, reaper, log }
    }

    /// The end of chromedriver's log, for failures.
    pub fn logs(&self) -> String {
        tail(&self.log, 40)
    }

    /// Runs `script` in the page (WebDriver's execute: the body of a
    /// function) and gives what it returns.
    pub async fn eval(&self, script: &str) -> Value {
        self.client.execute(script, Vec::new()).await.unwrap_or_else(|error| panic!("{script}: {error}"))
    }

    /// The address the browser is at.
    pub async fn url(&self) -> String {
        self.client.current_url().await.map(|url| url.to_string()).unwrap_or_else(|error| panic!("the URL: {error}"))
    }

    /// Polls until `check` gives a value (the page updates on its own
    /// clock); panics naming `what` after [`WAIT`].
    pub async fn until<T>(&self, what: &str, check: impl AsyncFnMut() -> Option<T>) -> T {
        poll(what, WAIT, Duration::from_millis(200), check, || self.logs()).await
    }

    /// Ends the session (Chromium quits) and chromedriver, then checks
    /// that no process of either is left.
    pub async fn close(mut self) {
        let _ = self.client.clone().close().await;
        let pid = i32::try_from(self.reaper.driver.id()).unwrap_or(i32::MAX);
        let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        let left = ServerProcess::wait_no_marked(&self.reaper.mark, Duration::from_secs(20)).await;
        self.reaper.kill_all();
        if let Err(left) = left {
            panic!("the browser left processes behind: {}", crate::harness::describe(&left));
        }
    }
}
