//! The log writer: formatted lines go through a bounded queue to one thread that writes them to
//! stderr, so logging never blocks the engine (a stalled reader of a pipe, a slow disk) and
//! never panics (a closed pipe, a full disk). A line that cannot be queued or written is
//! dropped and counted in `kubevol_log_lines_dropped_total`.

use std::io::Write;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use kubevol::metrics::count_dropped_log_lines;

/// Locks, ignoring poisoning (a counter is valid after any completed write).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How many lines may wait for the writer thread.
const QUEUE: usize = 8192;

/// Lines queued and not yet written, for [`Flush`].
#[derive(Default)]
struct Pending {
    lines: Mutex<usize>,
    drained: Condvar,
}

/// The `MakeWriter` given to tracing-subscriber.
#[derive(Clone)]
pub struct LogWriter {
    tx: SyncSender<Vec<u8>>,
    pending: Arc<Pending>,
}

/// Waits (briefly) for queued lines to be written when dropped, so the last lines before an
/// exit are not lost.
pub struct Flush(Arc<Pending>);

impl Drop for Flush {
    fn drop(&mut self) {
        let lines = lock(&self.0.lines);
        let _ = self
            .0
            .drained
            .wait_timeout_while(lines, Duration::from_secs(1), |n| *n > 0);
    }
}

impl LogWriter {
    /// A writer to `sink` (stderr in the daemon), with its writer thread.
    pub fn new(sink: impl Write + Send + 'static) -> (Self, Flush) {
        let (tx, rx) = sync_channel(QUEUE);
        let pending = Arc::new(Pending::default());
        let p = pending.clone();
        let spawned = std::thread::Builder::new()
            .name("kubevol-log".into())
            .spawn(move || write_lines(rx, sink, &p));
        if spawned.is_err() {
            // No thread: every line is dropped (and counted) instead of blocking anyone.
            count_dropped_log_lines(1);
        }
        (
            LogWriter {
                tx,
                pending: pending.clone(),
            },
            Flush(pending),
        )
    }
}

fn write_lines(rx: Receiver<Vec<u8>>, mut sink: impl Write, pending: &Pending) {
    while let Ok(line) = rx.recv() {
        if sink.write_all(&line).and_then(|()| sink.flush()).is_err() {
            count_dropped_log_lines(1);
        }
        let mut n = lock(&pending.lines);
        *n = n.saturating_sub(1);
        if *n == 0 {
            pending.drained.notify_all();
        }
    }
}

/// One event's line, queued when the formatter is done with it.
pub struct Line<'a> {
    buf: Vec<u8>,
    writer: &'a LogWriter,
}

impl Write for Line<'_> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for Line<'_> {
    fn drop(&mut self) {
        if self.buf.is_empty() {
            return;
        }
        let line = std::mem::take(&mut self.buf);
        *lock(&self.writer.pending.lines) += 1;
        match self.writer.tx.try_send(line) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                let mut n = lock(&self.writer.pending.lines);
                *n = n.saturating_sub(1);
                count_dropped_log_lines(1);
            }
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogWriter {
    type Writer = Line<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        Line {
            buf: Vec::new(),
            writer: self,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::fmt::MakeWriter;

    /// A sink that fails every write, as a closed pipe or a full disk does.
    struct Broken;
    impl Write for Broken {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(std::io::Error::from_raw_os_error(28))
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_failing_sink_drops_and_counts_lines_without_panicking() {
        let before = kubevol::metrics::dropped_log_lines();
        let (w, flush) = LogWriter::new(Broken);
        for _ in 0..3 {
            let mut line = w.make_writer();
            line.write_all(b"a line\n").unwrap();
        }
        drop(flush);
        assert!(kubevol::metrics::dropped_log_lines() >= before + 3);
    }

    #[test]
    fn a_sink_that_never_returns_blocks_no_writer() {
        /// A reader that stopped reading: every write waits until the test ends.
        struct Stalled(std::sync::mpsc::Receiver<()>);
        impl Write for Stalled {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                let _ = self.0.recv();
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let (release, stalled) = std::sync::mpsc::channel();
        let before = kubevol::metrics::dropped_log_lines();
        let (w, flush) = LogWriter::new(Stalled(stalled));
        // More lines than the queue holds: the ones over are dropped, none waits.
        for _ in 0..QUEUE + 100 {
            let mut line = w.make_writer();
            line.write_all(b"a line\n").unwrap();
        }
        assert!(kubevol::metrics::dropped_log_lines() >= before + 99);
        drop(release);
        drop(flush);
    }

    #[test]
    fn lines_reach_the_sink_whole_and_in_order() {
        #[derive(Clone, Default)]
        struct Shared(Arc<Mutex<Vec<u8>>>);
        impl Write for Shared {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let sink = Shared::default();
        let (w, flush) = LogWriter::new(sink.clone());
        for i in 0..100 {
            let mut line = w.make_writer();
            write!(line, "line ").unwrap();
            writeln!(line, "{i}").unwrap();
        }
        drop(flush);
        let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        let want: String = (0..100).map(|i| format!("line {i}\n")).collect();
        assert_eq!(text, want);
    }
}
