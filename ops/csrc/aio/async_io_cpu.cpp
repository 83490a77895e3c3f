// Asynchronous file I/O for tensors: the op under NVMe offload (zeroengine/ops/aio.py).
//
// A request (read a file range into a tensor, or write a tensor to a file range) is cut into block_size
// pieces that a pool of worker threads serve with pread/pwrite; submit() returns at once and wait() blocks
// (without the GIL) until every request submitted so far is done, then reports how many completed or throws
// one error naming each failed file. Why threads and not io_uring/libaio: neither library is present on the
// machines this is built on, and a pool of threads blocked in pread/pwrite keeps as many requests in flight
// as it has threads (queue_depth x thread_count, capped), which is what the drive's queue needs; measured
// against buffered and O_DIRECT copies in benchmarks/bench_aio.py.
//
// O_DIRECT (no page cache: the point of swapping past host memory) is used for every piece whose buffer
// address, length and file offset are multiples of kDirectAlignment, when the file system accepts it (tmpfs
// does not); other pieces, and such file systems, go through the page cache.

#include <torch/extension.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kDirectAlignment = 4096;
constexpr int64_t kMaxThreads = 64;

struct Request {
    std::string path;
    bool write = false;
    int fd = -1;         // through the page cache
    int direct_fd = -1;  // O_DIRECT, or -1 where the file system refuses it
    std::atomic<int64_t> pieces_left{0};
    std::mutex error_mutex;
    std::string error;

    ~Request() {
        if (fd >= 0) close(fd);
        if (direct_fd >= 0) close(direct_fd);
    }

    void fail(const std::string& what) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (error.empty()) error = what;
    }
};

struct Piece {
    std::shared_ptr<Request> request;
    char* data;
    int64_t nbytes;
    int64_t offset;
};

bool aligned(const Piece& p) {
    return reinterpret_cast<uintptr_t>(p.data) % kDirectAlignment == 0 && p.nbytes % kDirectAlignment == 0 &&
           p.offset % kDirectAlignment == 0;
}

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

// Reads or writes one piece in full (pread/pwrite may move fewer bytes than asked, and be interrupted).
void serve(const Piece& p) {
    Request& r = *p.request;
    const bool direct = r.direct_fd >= 0 && aligned(p);
    const int fd = direct ? r.direct_fd : r.fd;
    int64_t done = 0;
    while (done < p.nbytes) {
        const ssize_t n = r.write ? pwrite(fd, p.data + done, p.nbytes - done, p.offset + done)
                                  : pread(fd, p.data + done, p.nbytes - done, p.offset + done);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            r.fail(std::string(r.write ? "writing " : "reading ") + std::to_string(p.nbytes) + " bytes at offset " +
                   std::to_string(p.offset) + ": " + errno_text(errno));
            return;
        }
        if (n == 0) {
            r.fail("the file ends before offset " + std::to_string(p.offset + p.nbytes));
            return;
        }
        done += n;
    }
}

}  // namespace

class AsyncIO {
  public:
    AsyncIO(int64_t block_size, int64_t queue_depth, int64_t thread_count)
        : block_size_(block_size), queue_depth_(queue_depth), thread_count_(thread_count) {
        TORCH_CHECK(block_size > 0, "aio: block_size must be positive, got ", block_size);
        TORCH_CHECK(queue_depth > 0, "aio: queue_depth must be positive, got ", queue_depth);
        TORCH_CHECK(thread_count > 0, "aio: thread_count must be positive, got ", thread_count);
        const int64_t workers = std::min(kMaxThreads, queue_depth * thread_count);
        for (int64_t i = 0; i < workers; ++i) workers_.emplace_back([this] { work(); });
    }

    ~AsyncIO() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stopping_ = true;
        }
        queued_.notify_all();
        for (auto& t : workers_) t.join();
    }

    int64_t workers() const { return static_cast<int64_t>(workers_.size()); }

    // Queue reading (or writing) buffer's bytes from (to) path at file_offset; returns at once.
    void submit(const torch::Tensor& buffer, const std::string& path, int64_t file_offset, bool write) {
        TORCH_CHECK(buffer.device().is_cpu(), "aio: the buffer must be a CPU tensor (got ", buffer.device(), ")");
        TORCH_CHECK(buffer.is_contiguous(), "aio: the buffer must be contiguous");
        TORCH_CHECK(file_offset >= 0, "aio: file_offset must be >= 0, got ", file_offset);
        auto request = std::make_shared<Request>();
        request->path = path;
        request->write = write;
        const int flags = write ? (O_WRONLY | O_CREAT) : O_RDONLY;
        request->fd = open(path.c_str(), flags | O_CLOEXEC, 0644);
        if (request->fd < 0) {
            const int err = errno;
            TORCH_CHECK(false, "aio: cannot open ", path, " for ", write ? "writing" : "reading", ": ", errno_text(err));
        }
        request->direct_fd = open(path.c_str(), flags | O_CLOEXEC | O_DIRECT, 0644);  // -1: not on this FS
        const int64_t nbytes = buffer.numel() * buffer.element_size();
        if (!write) {
            struct stat st;
            TORCH_CHECK(fstat(request->fd, &st) == 0, "aio: cannot stat ", path);
            TORCH_CHECK(st.st_size >= file_offset + nbytes, "aio: ", path, " has ", st.st_size,
                        " bytes; reading ", nbytes, " at offset ", file_offset, " needs ", file_offset + nbytes);
        }
        char* data = static_cast<char*>(buffer.data_ptr());
        std::vector<Piece> pieces;
        for (int64_t start = 0; start < nbytes; start += block_size_)
            pieces.push_back({request, data + start, std::min(block_size_, nbytes - start), file_offset + start});
        request->pieces_left = static_cast<int64_t>(pieces.size());
        {
            std::lock_guard<std::mutex> lock(mutex_);
            ++submitted_;
            if (pieces.empty()) {
                ++completed_;
            } else {
                for (auto& p : pieces) queue_.push_back(std::move(p));
            }
        }
        queued_.notify_all();
    }

    // Block until every request submitted so far is done; the number completed since the last wait, or an error
    // naming every request that failed.
    int64_t wait() {
        std::unique_lock<std::mutex> lock(mutex_);
        finished_.wait(lock, [this] { return completed_ == submitted_; });
        const int64_t count = completed_ - reported_;
        reported_ = completed_;
        std::vector<std::string> errors;
        errors.swap(errors_);
        lock.unlock();
        if (!errors.empty()) {
            std::string all = "aio: " + std::to_string(errors.size()) + " of " + std::to_string(count) +
                              " request(s) failed:";
            for (auto& e : errors) all += "\n  " + e;
            throw std::runtime_error(all);
        }
        return count;
    }

    int64_t block_size() const { return block_size_; }
    int64_t queue_depth() const { return queue_depth_; }
    int64_t thread_count() const { return thread_count_; }

  private:
    void work() {
        for (;;) {
            Piece piece;
            {
                std::unique_lock<std::mutex> lock(mutex_);
                queued_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
                if (queue_.empty()) return;  // stopping, nothing left
                piece = std::move(queue_.front());
                queue_.pop_front();
            }
            serve(piece);
            if (--piece.request->pieces_left == 0) finish(*piece.request);
        }
    }

    void finish(Request& r) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!r.error.empty()) errors_.push_back(r.path + ": " + r.error);
        ++completed_;
        if (completed_ == submitted_) finished_.notify_all();
    }

    const int64_t block_size_, queue_depth_, thread_count_;
    std::vector<std::thread> workers_;
    std::mutex mutex_;
    std::condition_variable queued_, finished_;
    std::deque<Piece> queue_;
    std::vector<std::string> errors_;
    int64_t submitted_ = 0, completed_ = 0, reported_ = 0;
    bool stopping_ = false;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.attr("DIRECT_ALIGNMENT") = kDirectAlignment;
    py::class_<AsyncIO>(m, "AsyncIO")
        .def(py::init<int64_t, int64_t, int64_t>(), py::arg("block_size"), py::arg("queue_depth"),
             py::arg("thread_count"))
        .def("submit", &AsyncIO::submit, py::arg("buffer"), py::arg("path"), py::arg("file_offset"), py::arg("write"))
        .def("wait", &AsyncIO::wait, py::call_guard<py::gil_scoped_release>())
        .def("workers", &AsyncIO::workers)
        .def("block_size", &AsyncIO::block_size)
        .def("queue_depth", &AsyncIO::queue_depth)
        .def("thread_count", &AsyncIO::thread_count);
}
