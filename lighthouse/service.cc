#include "lighthouse/service.h"

#include "lighthouse/service_impl.h"

namespace lk::lighthouse {


Service::Service(asio::io_context& ioc, ServiceOptions options, std::unique_ptr<StateStore> store)
    : impl_(std::make_shared<Impl>(ioc, std::move(options), std::move(store))) {}

Service::~Service() = default;

Status Service::Start() { return impl_->Start(); }

std::string Service::address() const {
  return impl_->server ? impl_->server->LocalAddress() : "";
}

void Service::Shutdown() { impl_->Shutdown(); }

}  // namespace lk::lighthouse
