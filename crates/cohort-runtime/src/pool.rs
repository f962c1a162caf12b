//! The pool of physical workers.
//!
//! `trainer.max_concurrency` threads, each with its own model instance and its
//! own compute-thread pool, are reused for every logical client: two clients per
//! round with one worker means that worker trains both in turn. Memory grows
//! with workers, not with `total_clients`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use cohort_core::data::Dataset;
use cohort_core::tree::ParamTree;
use cohort_train::trainer::{ClientTask, LocalTrainer, LocalUpdate, TrainError};

/// One logical client's work for a round.
pub struct Job {
    /// Position of the client in the round's selection; results come back with it.
    pub slot: usize,
    pub task: ClientTask,
    pub global: Arc<ParamTree>,
    pub partition: Arc<Vec<u32>>,
    pub learning_rate: f64,
}

/// A finished job.
pub struct JobResult {
    pub slot: usize,
    pub task: ClientTask,
    pub worker: usize,
    pub outcome: Result<LocalUpdate, TrainError>,
}

pub struct WorkerPool {
    jobs: Option<Sender<Job>>,
    /// Set by [`WorkerPool::cancel`]: workers skip the jobs still queued.
    cancelled: Arc<AtomicBool>,
    results: Receiver<JobResult>,
    handles: Vec<JoinHandle<()>>,
}

impl WorkerPool {
    /// Starts one thread per trainer. Each runs its jobs inside its own rayon
    /// pool of `threads_per_worker` threads, so the tensor backend uses exactly
    /// that many cores per worker instead of the whole machine each.
    pub fn start(
        trainers: Vec<LocalTrainer>,
        data: Arc<Dataset>,
        threads_per_worker: usize,
    ) -> anyhow::Result<Self> {
        let (job_sender, job_receiver) = mpsc::channel::<Job>();
        let job_receiver = Arc::new(Mutex::new(job_receiver));
        let (result_sender, results) = mpsc::channel();
        let mut handles = Vec::new();
        let cancelled = Arc::new(AtomicBool::new(false));
        for (worker, mut trainer) in trainers.into_iter().enumerate() {
            let compute = rayon::ThreadPoolBuilder::new()
                .num_threads(threads_per_worker)
                .thread_name(move |i| format!("cohort-worker{worker}-compute{i}"))
                .build()?;
            let jobs = Arc::clone(&job_receiver);
            let results = result_sender.clone();
            let data = Arc::clone(&data);
            let cancelled = Arc::clone(&cancelled);
            let handle = std::thread::Builder::new()
                .name(format!("cohort-worker{worker}"))
                .spawn(move || {
                    loop {
                        // Hold the lock only to take a job, not while training.
                        let next = jobs.lock().map(|receiver| receiver.recv());
                        let Ok(Ok(job)) = next else { break };
                        if cancelled.load(Ordering::Relaxed) {
                            break;
                        }
                        let outcome = compute.install(|| {
                            trainer.train(
                                job.task,
                                &job.global,
                                &data,
                                &job.partition,
                                job.learning_rate,
                            )
                        });
                        let result = JobResult {
                            slot: job.slot,
                            task: job.task,
                            worker,
                            outcome,
                        };
                        if results.send(result).is_err() {
                            break;
                        }
                    }
                })?;
            handles.push(handle);
        }
        Ok(Self {
            jobs: Some(job_sender),
            cancelled,
            results,
            handles,
        })
    }

    pub fn submit(&self, job: Job) -> anyhow::Result<()> {
        self.jobs
            .as_ref()
            .expect("jobs sender lives until drop")
            .send(job)
            .map_err(|_| anyhow::anyhow!("all workers have stopped"))
    }

    /// Drops the jobs not yet started; a job in progress finishes.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }

    /// Waits for the next finished job.
    pub fn next_result(&self) -> anyhow::Result<JobResult> {
        self.results.recv().map_err(|_| {
            anyhow::anyhow!("a worker thread stopped unexpectedly (it may have panicked)")
        })
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        self.jobs.take();
        for handle in self.handles.drain(..) {
            let _ = handle.join();
        }
    }
}
