//! Parallel work on the OpenMP thread team the process already runs: torch's.
//!
//! torch does its CPU parallel work on an OpenMP team (`libgomp`, Intel's `libiomp5` or LLVM's
//! `libomp`, all of which export the GNU entry points). Between ops its workers spin-wait for
//! the next parallel region, so a kernel that starts threads of its own competes with them for
//! the cores: on 2 cores with 2 torch threads a 64-row decode attention call ran ~2.5x slower
//! right after a matmul than alone. Running the kernel's parts *as* a parallel region of that
//! team instead hands them to the spinning workers.
//!
//! The runtime is found, not linked: a call looks in `/proc/self/maps` for torch's
//! `libtorch_cpu` (whose own OpenMP library its symbols resolve to), else any OpenMP library
//! already loaded, reopens it with `RTLD_NOLOAD` (no second copy) and looks up `GOMP_parallel`,
//! `omp_get_thread_num` and `omp_get_num_threads`: once found, kept for the process; a miss is
//! looked up again at most once a second. Linux only;
//! elsewhere, or with no OpenMP loaded, [`run_on_team`] says so and the caller uses threads of
//! its own.

use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

type Region = unsafe extern "C" fn(*mut c_void);
type GompParallel = unsafe extern "C" fn(Region, *mut c_void, u32, u32);
type OmpQuery = unsafe extern "C" fn() -> i32;

/// The three entry points of the process's OpenMP runtime.
#[derive(Clone, Copy)]
struct Runtime {
    parallel: GompParallel,
    thread_num: OmpQuery,
    num_threads: OmpQuery,
}

static RUNTIME: OnceLock<Runtime> = OnceLock::new();

#[cfg(target_os = "linux")]
fn find_runtime() -> Option<Runtime> {
    use std::ffi::CString;
    use std::os::raw::{c_char, c_int};
    extern "C" {
        fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
        fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    }
    const RTLD_NOW: c_int = 2;
    const RTLD_NOLOAD: c_int = 4;
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let name = |path: &str| path.rsplit('/').next().unwrap_or("").to_owned();
    let is_openmp = |path: &str| ["libgomp", "libiomp5", "libomp."].iter().any(|prefix| name(path).starts_with(prefix));
    let mut paths: Vec<&str> = maps.lines().filter_map(|line| line.split_whitespace().nth(5)).collect();
    paths.dedup();
    // torch's own runtime first: symbols looked up through libtorch_cpu resolve to the OpenMP
    // library it links (another package may load a second one); then any OpenMP library.
    let candidates =
        paths.iter().filter(|path| name(path).starts_with("libtorch_cpu.")).chain(paths.iter().filter(|path| is_openmp(path)));
    for path in candidates {
        let Ok(path) = CString::new(*path) else { continue };
        // SAFETY: plain libc calls on NUL-terminated strings; RTLD_NOLOAD only returns a
        // library that is already loaded (it runs no initialisers).
        unsafe {
            let handle = dlopen(path.as_ptr(), RTLD_NOW | RTLD_NOLOAD);
            if handle.is_null() {
                continue;
            }
            let symbol = |name: &str| {
                let name = CString::new(name).expect("no NUL in a symbol name");
                let address = dlsym(handle, name.as_ptr());
                (!address.is_null()).then_some(address)
            };
            if let (Some(parallel), Some(thread_num), Some(num_threads)) =
                (symbol("GOMP_parallel"), symbol("omp_get_thread_num"), symbol("omp_get_num_threads"))
            {
                return Some(Runtime {
                    parallel: std::mem::transmute::<*mut c_void, GompParallel>(parallel),
                    thread_num: std::mem::transmute::<*mut c_void, OmpQuery>(thread_num),
                    num_threads: std::mem::transmute::<*mut c_void, OmpQuery>(num_threads),
                });
            }
        }
    }
    None
}

#[cfg(not(target_os = "linux"))]
fn find_runtime() -> Option<Runtime> {
    None
}

/// When the last lookup found nothing: a miss is looked up again at most once a second (a
/// process may load torch after its first call here, and reading the maps costs ~0.1 ms).
static LAST_MISS: Mutex<Option<Instant>> = Mutex::new(None);

/// The runtime, kept once found.
fn runtime() -> Option<Runtime> {
    if let Some(found) = RUNTIME.get() {
        return Some(*found);
    }
    let mut last_miss = LAST_MISS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if last_miss.is_some_and(|at| at.elapsed() < Duration::from_secs(1)) {
        return None;
    }
    match find_runtime() {
        Some(found) => Some(*RUNTIME.get_or_init(|| found)),
        None => {
            *last_miss = Some(Instant::now());
            None
        }
    }
}

/// Whether this process has an OpenMP team to run on.
pub fn available() -> bool {
    runtime().is_some()
}

struct Job<'a> {
    work: &'a (dyn Fn(usize, usize) + Sync),
    runtime: Runtime,
    panicked: std::sync::atomic::AtomicBool,
}

unsafe extern "C" fn region(data: *mut c_void) {
    // SAFETY: `data` is the `Job` `run_on_team` passes, alive until GOMP_parallel returns.
    let job = &*(data as *const Job);
    let (index, size) = ((job.runtime.thread_num)() as usize, (job.runtime.num_threads)() as usize);
    // A panic must not unwind into C: record it and report it after the region.
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (job.work)(index, size.max(1)))).is_err() {
        job.panicked.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Runs `work(thread_index, team_size)` on every thread of an OpenMP parallel region of up to
/// `threads` threads (the calling thread is index 0; the runtime may give fewer, so `work`
/// splits by the size it is told). Returns `None` when there is no OpenMP runtime (module doc),
/// else `Some(ok)`, `ok` false if `work` panicked on some thread.
pub fn run_on_team(threads: usize, work: &(dyn Fn(usize, usize) + Sync)) -> Option<bool> {
    let runtime = runtime()?;
    let job = Job { work, runtime, panicked: false.into() };
    // SAFETY: `region` only reads `job`, which outlives the call; GOMP_parallel returns after
    // every thread of the region has finished.
    unsafe { (runtime.parallel)(region, &job as *const Job as *mut c_void, threads.max(1) as u32, 0) };
    Some(!job.panicked.load(std::sync::atomic::Ordering::Relaxed))
}

/// Runs `work(thread_index, num_threads)` on up to `threads` threads: as a region of the
/// OpenMP team when there is one ([`run_on_team`]), else on scoped threads of its own (the
/// calling thread is index 0). Returns false if `work` panicked on a team thread (a panic on a
/// scoped thread propagates).
pub fn run_parallel(threads: usize, work: &(dyn Fn(usize, usize) + Sync)) -> bool {
    if threads <= 1 {
        work(0, 1);
        return true;
    }
    if let Some(ok) = run_on_team(threads, work) {
        return ok;
    }
    std::thread::scope(|scope| {
        for index in 1..threads {
            scope.spawn(move || work(index, threads));
        }
        work(0, threads);
    });
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn run_parallel_runs_every_index_once() {
        let seen = AtomicUsize::new(0);
        assert!(run_parallel(3, &|index, size| {
            assert_eq!(size, 3);
            seen.fetch_add(1 << (4 * index), Ordering::Relaxed);
        }));
        assert_eq!(seen.load(Ordering::Relaxed), 0x111);
    }

    #[test]
    fn every_index_runs_once_or_there_is_no_team() {
        // cargo's test binary links no OpenMP: the fallback answer. With torch loaded (the
        // Python tests) the team runs the work.
        let seen = AtomicUsize::new(0);
        let calls = AtomicUsize::new(0);
        match run_on_team(3, &|index, size| {
            assert!(index < size);
            seen.fetch_or(1 << index, Ordering::Relaxed);
            calls.fetch_add(1, Ordering::Relaxed);
        }) {
            None => assert!(!available()),
            Some(ok) => {
                assert!(ok);
                let n = calls.load(Ordering::Relaxed);
                assert_eq!(seen.load(Ordering::Relaxed), (1 << n) - 1);
            }
        }
    }
}
