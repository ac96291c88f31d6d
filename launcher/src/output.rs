//! Worker output: one thread per pipe reads whole lines and writes them to the rank's log file
//! and/or the console as `[rank N] line` (one locked write per line, so lines never
//! interleave; stderr lines of several ranks pass the `merge` of alike lines), keeping the last
//! lines of stderr for the failure summary.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::LaunchError;
use crate::merge::LineMerger;
use crate::progress::{ConsoleBar, PROGRESS_PREFIX};

/// Lines of stderr kept per rank for the summary.
pub const TAIL_LINES: usize = 20;
/// Longest line kept in the tail (longer ones are cut).
const TAIL_LINE_CHARS: usize = 400;

/// Which stream a pipe carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    fn suffix(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// Log files that could not be written, one message each (shared by every pipe reader).
pub type LogErrors = Arc<Mutex<Vec<String>>>;

/// Where worker output goes, shared by every pipe reader.
#[derive(Debug, Clone)]
pub struct OutputConfig {
    pub log_dir: Option<PathBuf>,
    /// Where readers report a log file they could not write.
    pub log_errors: LogErrors,
    /// Print to the console (no log dir, or --tee).
    pub console: bool,
    /// Console only for these global ranks (None: all).
    pub ranks_filter: Option<Vec<usize>>,
    /// The bar drawn from rank 0's progress lines (the console is a terminal).
    pub bar: Option<ConsoleBar>,
    /// Where the console's stderr lines go when several ranks of this node are shown: alike
    /// lines are printed once, with the ranks' list.
    pub merger: Option<Arc<LineMerger>>,
}

impl OutputConfig {
    /// Whether rank `rank`'s output is printed on this console.
    pub fn console_for(&self, rank: usize) -> bool {
        self.console
            && self
                .ranks_filter
                .as_ref()
                .is_none_or(|ranks| ranks.contains(&rank))
    }

    /// Path of one rank's log file.
    pub fn log_path(dir: &Path, rank: usize, stream: Stream) -> PathBuf {
        dir.join(format!("rank_{rank}.{}", stream.suffix()))
    }
}

/// The last lines of a rank's stderr.
pub type Tail = Arc<Mutex<VecDeque<String>>>;

/// Reader threads of one worker; `finished` gets one message per thread at EOF.
pub struct Pipes {
    pub tail: Tail,
    threads: Vec<JoinHandle<()>>,
    finished: Receiver<()>,
}

impl Pipes {
    /// Starts reading a worker's stdout and stderr. `append` keeps earlier generations' logs.
    pub fn start(
        cfg: &OutputConfig,
        rank: usize,
        stdout: impl Read + Send + 'static,
        stderr: impl Read + Send + 'static,
        append: bool,
    ) -> Result<Pipes, LaunchError> {
        let tail: Tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL_LINES)));
        let (tx, finished) = std::sync::mpsc::channel();
        let mut threads = Vec::with_capacity(2);
        for (stream, reader) in [
            (Stream::Stdout, Box::new(stdout) as Box<dyn Read + Send>),
            (Stream::Stderr, Box::new(stderr) as Box<dyn Read + Send>),
        ] {
            let file = match &cfg.log_dir {
                Some(dir) => Some(LogFile {
                    file: open_log(dir, rank, stream, append)?,
                    path: OutputConfig::log_path(dir, rank, stream),
                    errors: Arc::clone(&cfg.log_errors),
                }),
                None => None,
            };
            let console = cfg.console_for(rank);
            let bar = cfg.bar.clone().filter(|_| console);
            let tail = (stream == Stream::Stderr).then(|| tail.clone());
            let merger = cfg
                .merger
                .clone()
                .filter(|_| console && stream == Stream::Stderr);
            if let Some(m) = &merger {
                m.open(rank);
            }
            let tx: Sender<()> = tx.clone();
            let handle = std::thread::Builder::new()
                .name(format!("rank{rank}-{}", stream.suffix()))
                .spawn(move || {
                    let console = match (console, merger.as_deref()) {
                        (false, _) => Console::Off,
                        (true, Some(m)) => Console::Merged(m),
                        (true, None) => Console::Direct(bar.as_ref()),
                    };
                    pump(rank, stream, reader, file, &console, tail);
                    if let Console::Merged(m) = console {
                        m.close(rank);
                    }
                    let _ = tx.send(());
                })
                .map_err(|e| LaunchError::io("starting an output thread", e))?;
            threads.push(handle);
        }
        Ok(Pipes {
            tail,
            threads,
            finished,
        })
    }

    /// Waits (up to `timeout`) for both pipes to reach EOF, so the last lines are written.
    pub fn drain(self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut done = 0;
        while done < self.threads.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.finished.recv_timeout(left) {
                Ok(()) => done += 1,
                Err(_) => {
                    tracing::warn!(
                        "worker output still open after {timeout:?} (a child process of the \
                         worker may hold it); not waiting longer"
                    );
                    return;
                }
            }
        }
        for t in self.threads {
            let _ = t.join();
        }
    }
}

fn open_log(dir: &Path, rank: usize, stream: Stream, append: bool) -> Result<File, LaunchError> {
    let path = OutputConfig::log_path(dir, rank, stream);
    OpenOptions::new()
        .create(true)
        .write(true)
        .append(append)
        .truncate(!append)
        .open(&path)
        .map_err(|e| LaunchError::io(format!("opening log file {}", path.display()), e))
}

/// One rank's log file, and where a failed write is reported.
struct LogFile {
    file: File,
    path: PathBuf,
    errors: LogErrors,
}

/// Where a pipe's lines go on the console.
enum Console<'a> {
    Off,
    /// Printed at once (above the bar, if any).
    Direct(Option<&'a ConsoleBar>),
    /// Through the merger of alike lines.
    Merged(&'a LineMerger),
}

impl Console<'_> {
    fn bar(&self) -> Option<&ConsoleBar> {
        match self {
            Console::Direct(bar) => *bar,
            _ => None,
        }
    }
}

fn pump(
    rank: usize,
    stream: Stream,
    reader: Box<dyn Read + Send>,
    mut file: Option<LogFile>,
    console: &Console<'_>,
    tail: Option<Tail>,
) {
    let bar = console.bar();
    let mut drew = false;
    let mut reader = BufReader::new(reader);
    let prefix = format!("[rank {rank}] ");
    let mut line = Vec::with_capacity(256);
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        }
        if line.last() != Some(&b'\n') {
            line.push(b'\n');
        }
        if stream == Stream::Stdout && line.starts_with(PROGRESS_PREFIX.as_bytes()) {
            if let Some(b) = bar {
                drew |= b.update(&String::from_utf8_lossy(&line));
            }
            continue;
        }
        if let Some(f) = file.as_mut() {
            if let Err(e) = f.file.write_all(&line) {
                // Later lines of this stream still reach the console (when shown) and the tail.
                let msg = format!(
                    "rank {rank}'s {} log {}: {e}; later lines of it were not written",
                    stream.suffix(),
                    f.path.display()
                );
                tracing::error!("{msg}");
                if let Ok(mut errors) = f.errors.lock() {
                    errors.push(msg);
                }
                file = None;
            }
        }
        match console {
            Console::Off => {}
            Console::Merged(m) => m.push(rank, &line),
            Console::Direct(bar) => {
                let mut out = Vec::with_capacity(prefix.len() + line.len());
                out.extend_from_slice(prefix.as_bytes());
                out.extend_from_slice(&line);
                // One write under the stream's lock: whole lines only (above the bar, if any).
                match bar {
                    Some(b) => b.write(&out, stream == Stream::Stdout),
                    None => {
                        let _ = match stream {
                            Stream::Stdout => std::io::stdout().lock().write_all(&out),
                            Stream::Stderr => std::io::stderr().lock().write_all(&out),
                        };
                    }
                }
            }
        }
        if let Some(tail) = &tail {
            let text = String::from_utf8_lossy(&line[..line.len() - 1]);
            let text: String = text.chars().take(TAIL_LINE_CHARS).collect();
            if let Ok(mut t) = tail.lock() {
                if t.len() == TAIL_LINES {
                    t.pop_front();
                }
                t.push_back(text);
            }
        }
    }
    if let (true, Some(b)) = (drew, bar) {
        b.finish();
    }
    if stream == Stream::Stdout && !matches!(console, Console::Off) {
        let _ = std::io::stdout().lock().flush();
    }
}
