//! A PostgreSQL cluster of our own (Debian's `postgresql` package; tests/run-all.sh installs
//! it) for the suites that write the audit trail there: `initdb` in a temporary directory (as
//! the `postgres` user when the tests run as root), a free loopback port, `fsync` off.

use std::process::{Command, Stdio};

/// A PostgreSQL cluster of our own; stopped and removed when dropped.
pub struct Pg {
    dir: tempfile::TempDir,
    pub port: u16,
    bin: std::path::PathBuf,
}

/// Runs `program args` as the `postgres` user when this process is root (PostgreSQL refuses
/// to run as root), else as ourselves.
fn as_pg_user(program: &std::path::Path, args: &[&str]) -> Command {
    let root = std::env::var("USER").as_deref() == Ok("root")
        || Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| o.stdout.starts_with(b"0\n"));
    if root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program).args(args);
        c
    } else {
        let mut c = Command::new(program);
        c.args(args);
        c
    }
}

impl Pg {
    pub fn start() -> Pg {
        let bin = ["/usr/lib/postgresql/15/bin", "/usr/lib/postgresql/16/bin"]
            .iter()
            .map(std::path::PathBuf::from)
            .find(|p| p.join("initdb").exists())
            .expect(
                "PostgreSQL's initdb (Debian's postgresql package; tests/run-all.sh installs it)",
            );
        let dir = tempfile::Builder::new().prefix("ah-pg").tempdir().unwrap();
        // The postgres user must own its directory.
        let _ = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(dir.path())
            .status();
        let data = dir.path().join("data");
        let ok = as_pg_user(
            &bin.join("initdb"),
            &[
                "-D",
                data.to_str().unwrap(),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
            ],
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
        assert!(ok.success(), "initdb failed");
        // A port another process takes between our pick and PostgreSQL's bind is picked again.
        let mut pg = Pg { dir, port: 0, bin };
        for _ in 0..10 {
            pg.port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            if pg.try_ctl_start() {
                return pg;
            }
        }
        panic!("PostgreSQL found no free port in ten tries");
    }

    pub fn ctl_start(&self) {
        assert!(self.try_ctl_start(), "pg_ctl start failed");
    }

    fn try_ctl_start(&self) -> bool {
        let data = self.dir.path().join("data");
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=100",
            self.port,
            self.dir.path().display()
        );
        let log = self.dir.path().join("pg.log");
        let ok = as_pg_user(
            &self.bin.join("pg_ctl"),
            &[
                "-D",
                data.to_str().unwrap(),
                "-o",
                &opts,
                "-l",
                log.to_str().unwrap(),
                "-w",
                "-t",
                "30",
                "start",
            ],
        )
        .stdout(Stdio::null())
        .status()
        .unwrap();
        ok.success()
    }

    pub fn ctl_stop(&self) {
        let data = self.dir.path().join("data");
        let _ = as_pg_user(
            &self.bin.join("pg_ctl"),
            &[
                "-D",
                data.to_str().unwrap(),
                "-m",
                "immediate",
                "-w",
                "stop",
            ],
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    }

    /// A new database of its own; its URL.
    pub async fn database(&self, name: &str) -> String {
        let admin = self.client("postgres").await;
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
        self.url(name)
    }

    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    pub async fn client(&self, db: &str) -> tokio_postgres::Client {
        let (c, conn) = tokio_postgres::connect(&self.url(db), tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        c
    }
}

impl Drop for Pg {
    fn drop(&mut self) {
        self.ctl_stop();
    }
}
