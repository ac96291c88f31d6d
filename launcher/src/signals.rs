//! SIGINT/SIGTERM/SIGHUP to oflaunch: a handler writes the signal number into a self-pipe that
//! the supervision loop polls (with a timeout), so signals become ordinary events.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};

use crate::error::LaunchError;

static WRITE_FD: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_signal(signo: libc::c_int) {
    let fd = WRITE_FD.load(Ordering::Relaxed);
    if fd >= 0 {
        let byte = signo as u8;
        // SAFETY: write(2) is async-signal-safe; the pipe is non-blocking, so a full pipe drops
        // the byte instead of blocking (earlier bytes already report a signal).
        unsafe {
            libc::write(fd, (&byte as *const u8).cast(), 1);
        }
    }
}

/// The read end of the self-pipe; signals arrive as bytes holding their numbers.
pub struct SignalPipe {
    read_fd: RawFd,
}

/// The signals oflaunch forwards to its workers.
pub const FORWARDED: [Signal; 3] = [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP];

impl SignalPipe {
    /// Installs the handlers (once per process).
    pub fn install() -> Result<SignalPipe, LaunchError> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: pipe2 writes two fds into the array we own.
        let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) };
        if rc != 0 {
            return Err(LaunchError::io(
                "creating the signal pipe",
                std::io::Error::last_os_error(),
            ));
        }
        WRITE_FD.store(fds[1], Ordering::Relaxed);
        let action = SigAction::new(
            SigHandler::Handler(on_signal),
            SaFlags::SA_RESTART,
            SigSet::empty(),
        );
        for sig in FORWARDED {
            // SAFETY: the handler only calls write(2) on a non-blocking fd.
            unsafe { sigaction(sig, &action) }
                .map_err(|e| LaunchError::io(format!("installing the {sig} handler"), e.into()))?;
        }
        // A log file over the file-size limit must fail its write (EFBIG, reported), not kill
        // oflaunch before its summary. Workers get the default back (see `spawn`).
        // SAFETY: setting a signal disposition to SIG_IGN.
        unsafe {
            sigaction(
                Signal::SIGXFSZ,
                &SigAction::new(SigHandler::SigIgn, SaFlags::empty(), SigSet::empty()),
            )
        }
        .map_err(|e| LaunchError::io("ignoring SIGXFSZ", e.into()))?;
        Ok(SignalPipe { read_fd: fds[0] })
    }

    /// Waits up to `timeout` for a signal or for one of `also` to become readable; returns the
    /// signals received (possibly none) and which of `also` are readable.
    pub fn wait(&self, also: &[RawFd], timeout: Duration) -> (Vec<Signal>, Vec<RawFd>) {
        let mut pfds: Vec<libc::pollfd> = std::iter::once(self.read_fd)
            .chain(also.iter().copied())
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
        let count = pfds.len() as libc::nfds_t;
        // SAFETY: `count` valid pollfds in a buffer we own.
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), count, ms) };
        let mut out = Vec::new();
        if n <= 0 {
            return (out, Vec::new());
        }
        let ready = pfds[1..]
            .iter()
            .filter(|p| p.revents != 0)
            .map(|p| p.fd)
            .collect();
        if pfds[0].revents & libc::POLLIN == 0 {
            return (out, ready);
        }
        let mut buf = [0u8; 64];
        loop {
            // SAFETY: reading into our own buffer from our own non-blocking fd.
            let got = unsafe { libc::read(self.read_fd, buf.as_mut_ptr().cast(), buf.len()) };
            if got <= 0 {
                break;
            }
            for &b in &buf[..got as usize] {
                if let Ok(sig) = Signal::try_from(b as libc::c_int) {
                    out.push(sig);
                }
            }
        }
        (out, ready)
    }
}
